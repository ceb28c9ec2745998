"""fuse_wqa_wkv: horizontal GEMM fusion of sibling projections.

Every group of matrix products that read the same activation with constant (frozen) weights of
one dtype becomes one product over the weights concatenated along the output dim, followed by a
split. In this model that is `attn.wq_a` with the window `attn.wkv` in every layer (spec §13.1),
plus, on kv sources, the compressor projections and `indexer.weights_proj` where dtypes agree.
The concatenated weight is built once, at compile time, as a new constant of the graph module.

Before:                                       After:
    x   = view(attn_in, [T, D])                   x   = view(attn_in, [T, D])
    q_a = mm(x, W_qa)       # [T, r_q]            qkv = mm(x, W_fused)    # W_fused = cat([W_qa, W_kv], 1)
    kv  = mm(x, W_kv)       # [T, d_h]            q_a = slice(qkv, 1, 0, r_q)
                                                  kv  = slice(qkv, 1, r_q, r_q + d_h)

Needs frozen weights (Inductor `freezing`), which `dsv41c.compile` turns on; on a graph whose
weights are inputs it matches nothing.
"""
from __future__ import annotations

import torch
from torch import fx

from dsv41c.passes.manager import GraphPass, PassStats

aten = torch.ops.aten
VIEW_OPS = {aten.permute.default: lambda t, dims: t.permute(dims), aten.t.default: lambda t: t.t(),
            aten.view.default: lambda t, shape: t.view(shape), aten.reshape.default: lambda t, s: t.reshape(s)}


def constant_value(node, gm: torch.nn.Module) -> torch.Tensor | None:
    """The value of a node computed from graph constants by view-like ops only, else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        value = getattr(gm, node.target, None)
        return value if isinstance(value, torch.Tensor) else None
    if node.op == "call_function" and node.target in VIEW_OPS:
        base = constant_value(node.args[0], gm)
        return None if base is None else VIEW_OPS[node.target](base, *node.args[1:])
    return None


class FuseSiblingLinears(GraphPass):
    name = "fuse_wqa_wkv"

    def apply(self, graph: fx.Graph) -> PassStats:
        stats = PassStats(self.name)
        gm = graph.owning_module
        groups: dict[tuple, list[tuple[fx.Node, torch.Tensor]]] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is aten.mm.default:
                weight = constant_value(node.args[1], gm)
                if weight is not None:
                    groups.setdefault((node.args[0], weight.dtype, weight.device), []).append((node, weight))
        for (activation, _, _), members in groups.items():
            if len(members) < 2:
                continue
            self._fuse(graph, gm, activation, members, stats)
        return stats

    def _fuse(self, graph: fx.Graph, gm, activation: fx.Node, members, stats: PassStats) -> None:
        fused = torch.cat([w for _, w in members], dim=1).contiguous()
        name = f"_dsv41c_fused_weight_{sum(1 for n in graph.nodes if n.op == 'get_attr')}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, fused)
        fake_mode = activation.meta["val"].fake_mode
        first = members[0][0]
        with graph.inserting_before(first):
            w_node = graph.get_attr(name)
            w_node.meta["val"] = fake_mode.from_tensor(fused, static_shapes=True)
            mm = graph.call_function(aten.mm.default, (activation, w_node))
            with fake_mode:
                mm.meta["val"] = aten.mm.default(activation.meta["val"], w_node.meta["val"])
        start = 0
        for node, w in members:
            width = w.shape[1]
            with graph.inserting_after(mm):
                part = graph.call_function(aten.slice.Tensor, (mm, 1, start, start + width))
                with fake_mode:
                    part.meta["val"] = aten.slice.Tensor(mm.meta["val"], 1, start, start + width)
            node.replace_all_uses_with(part)
            graph.erase_node(node)
            start += width
        stats.matches += 1
        stats.nodes_removed += len(members)
        stats.nodes_added += 2 + len(members)
        stats.details.append(f"{len(members)} GEMMs on {activation.name} -> one [{fused.shape[0]} x {fused.shape[1]}]")
