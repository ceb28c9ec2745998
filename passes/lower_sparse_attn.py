"""lower_sparse_attn: every eager `sparse_attn` call (spec §6.8) becomes one TileLang kernel call.

The eager `dsv41c.attention.sparse_attn` gathers the listed rows, then runs an einsum, masking, an
exact or blocked online softmax and a second einsum; in the post-grad graph those are a few dozen
aten ops per layer (the bf16 form unrolls one block of ops per 64 list entries). The pass finds
them by provenance: the nodes traced from one call of `sparse_attn` form a site (`provenance.py`).
Layers that share an index list (Reuse layers) share the list's decoding after Inductor's CSE, so
a site's operands are found through the nodes of other sites: q [B,S,H,d], the rows kv [B,N,d],
the sink [H] (fp32) and the list idx [B,S,K] (int32). The scale is the attention module's `scale`
(the model is bound). The rows decide which kernel replaces the site:

    kv = cat(w, fp4_e4m3_dequant(cc, cs)), w = fp8_dequant(wc, ws)       (decode, packed caches)
        -> dsv41c.sparse_attn_packed(q, wc, ws, cc, cs, sink, idx, scale)
    kv = cat(w, fp4_e4m3_dequant(cc, cs)), w any rows in q's dtype       (prefill: fresh rows)
        -> dsv41c.sparse_attn_packed(q, w, None, cc, cs, sink, idx, scale)
    kv = fp8_dequant(wc, ws)                                              (decode, window only)
        -> dsv41c.sparse_attn_packed(q, wc, ws, <empty compressed rows>, sink, idx, scale)
    any other rows in q's dtype                                          (plain caches)
        -> dsv41c.sparse_attn(q, kv, sink, idx, scale)

The packed forms need the `fp4_kv` pass to have run first (its dequantise calls are what this
pass recognises); the dequantised rows then have no reader left and disappear, so the packed
bytes are read only inside the attention kernel.

Before (one layer, fp32, simplified):              After:
    g  = gather(kv, 1, expand(unsqueeze(view(          o = dsv41c.sparse_attn(q, kv, sink, idx, s)
             convert(clamp_min(idx, 0)))))
    l  = mul(bmm(view(q), view(permute(g))), s)
    l  = where(ge(idx, 0), l, -inf); m = amax(l) ...
    o  = div(bmm(exp(sub(l, m)), g), add(sum(..), exp(sub(sink, m))))

A site the kernels cannot take (fp32 on CUDA, whose build is bf16 only; rows in another dtype than
q; packed rows of a head dim the packed build does not take, e.g. tiny's 64 on CUDA) stays as
torch ops: it is reported in the stats and warned about, and strict mode makes it an
error naming the site.
"""
from __future__ import annotations


import torch
from torch import fx

from dsv41c.passes import provenance
from dsv41c.passes.manager import ModelPass, PassStats
from dsv41c.passes.provenance import Site, site_key

ATTENTION_FILE = "dsv41c/attention.py"


class Mismatch(Exception):
    """A site the kernels do not take (reported, left as torch ops)."""


def _key(node: fx.Node) -> tuple | None:
    return site_key(node, ATTENTION_FILE, ("sparse_attn",))


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _target_is(node: fx.Node, op) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is op


class LowerSparseAttn(ModelPass):
    name = "lower_sparse_attn"
    kernel_modules = ("attention", "quant")  # the attention; the rows' dequantise

    def apply(self, graph: fx.Graph) -> PassStats:
        self.bound_model()
        stats = PassStats(self.name)
        sites = provenance.find_sites(graph, _key)
        in_sites = _with_interior(graph, {n for s in sites for n in s.nodes})
        missed = []
        for site in sites:
            try:
                call = self._lower(graph, site, in_sites)
            except Mismatch as e:
                missed.append(f"{site.describe()}: {e}")
                continue
            stats.details.append(f"{call.target._opname} at {site.module or 'model'}")
            stats.nodes_added += 1
        stats.matches = len(stats.details)
        before = len(graph.nodes)
        provenance.prune(graph)
        stats.nodes_removed = before - len(graph.nodes)
        self.report_left(stats, missed, "site(s)")
        return stats

    # ------------------------------------------------------------------ one site
    def _lower(self, graph: fx.Graph, site: Site, in_sites: set) -> fx.Node:
        out = _output(site, in_sites)
        q, kv, sink, idx = _operands(site, in_sites, _val(out))
        scale = self._scale(site)
        qv, kvv = _val(q), _val(kv)
        if _val(out).dtype != qv.dtype:
            raise Mismatch(f"the output is {_val(out).dtype}, q is {qv.dtype}")
        if qv.device.type == "cuda" and qv.dtype != torch.bfloat16:
            raise Mismatch("the CUDA build takes bf16 only")
        packed = _packed_rows(kv, qv.dtype)
        if packed is not None:  # checked before any node is added: a site left keeps fp4_kv's dequantised rows
            from dsv41c.tilelang_kernels.attention import packed_head_dim_problem  # (loaded: kernel_modules)
            if (problem := packed_head_dim_problem(qv.shape[-1], qv.device.type == "cuda")) is not None:
                raise Mismatch(f"packed rows: {problem}")
        with graph.inserting_before(out):
            if _val(sink).dim() != 1:  # freezing folds sink.float().view(1, 1, H) into a constant
                sink = graph.call_function(torch.ops.aten.reshape.default, (sink, [_val(sink).shape[-1]]))
                sink.meta["val"] = _fake(sink.target, sink.args)
            if packed is None:
                if kvv.dtype != qv.dtype:
                    raise Mismatch(f"rows are {kvv.dtype}, q is {qv.dtype}")
                target, args = torch.ops.dsv41c.sparse_attn.default, (q, kv, sink, idx, scale)
            else:
                window, window_scales, cc, cs = packed
                if cc is None:  # no compressed rows: empty uint8 views of the ring's codes
                    d = kvv.shape[-1]
                    rows0 = graph.call_function(torch.ops.aten.slice.Tensor, (window, 1, 0, 0))
                    cc = graph.call_function(torch.ops.aten.slice.Tensor, (rows0, 2, 0, d // 2))
                    cs = graph.call_function(torch.ops.aten.slice.Tensor, (rows0, 2, 0, d // 16))
                    for node in (rows0, cc, cs):
                        node.meta["val"] = _fake(node.target, node.args)
                target = torch.ops.dsv41c.sparse_attn_packed.default
                args = (q, window, window_scales, cc, cs, sink, idx, scale)
            call = graph.call_function(target, args)
        call.meta["val"] = _fake(target, args)
        out.replace_all_uses_with(call)
        return call

    def _scale(self, site: Site) -> float:
        module = self.model.get_submodule(site.module) if site.module else self.model
        scale = getattr(module, "scale", None)
        if not isinstance(scale, float):
            raise Mismatch(f"module {site.module or 'model'} has no float `scale`")
        return scale


def _with_interior(graph: fx.Graph, in_sites: set) -> set:
    """in_sites plus the nodes Inductor rewrote inside the sites without their trace (e.g. the
    scale's product): computed from site nodes, read only by site nodes."""
    grown = True
    while grown:
        grown = False
        for node in reversed(graph.nodes):
            if (node not in in_sites and node.op == "call_function" and node.users and _key(node) is None
                    and all(u in in_sites for u in node.users)
                    and any(a in in_sites for a in node.all_input_nodes)):
                in_sites.add(node)
                grown = True
    return in_sites


def _operands(site: Site, in_sites: set, out: torch.Tensor) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node]:
    """(q, kv, sink, idx): the site's external tensor inputs, looking through nodes of other sites
    (a shared decoding of the index list).  out is the site's output value [B,S,H,d]."""
    found, seen, todo = [], set(), list(site.inputs)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in in_sites:
            todo.extend(node.all_input_nodes)
        elif _val(node) is not None and _val(node).dim() > 0:
            found.append(node)
    b, _, h, d = out.shape
    floats = (torch.float32, torch.bfloat16, torch.float16)

    def shaped(n):
        return tuple(_val(n).shape)
    roles = {
        "q": [n for n in found if shaped(n) == tuple(out.shape) and _val(n).dtype in floats],
        "kv": [n for n in found if _val(n).dim() == 3 and _val(n).dtype in floats
               and shaped(n)[0] == b and shaped(n)[2] == d],
        "sink": [n for n in found if _val(n).dtype == torch.float32 and shaped(n)[-1] == h
                 and all(x == 1 for x in shaped(n)[:-1]) and _val(n).dim() <= 3],
        "idx": [n for n in found if _val(n).dim() == 3 and _val(n).dtype == torch.int32],
    }
    roles["kv"] = [n for n in roles["kv"] if n not in roles["sink"]]
    for role, nodes in roles.items():
        if len(nodes) != 1:
            raise Mismatch(f"expected one {role} operand, found {len(nodes)}")
    return roles["q"][0], roles["kv"][0], roles["sink"][0], roles["idx"][0]


def _output(site: Site, in_sites: set) -> fx.Node:
    """The attention output: the site's one 4-D value read outside the sites (a shared constant,
    e.g. the -inf of the masking, may be read elsewhere too)."""
    outs = [n for n in site.outputs if any(u not in in_sites for u in n.users)
            and _val(n) is not None and _val(n).dim() == 4]
    if len(outs) != 1:
        raise Mismatch(f"expected one [B,S,H,d] output, found {len(outs)}")
    return outs[0]


def _dequant_of(node: fx.Node, fmt: str, dtype: torch.dtype) -> tuple[fx.Node, fx.Node] | None:
    """(codes, scales) if node is `dsv41c.<fmt>_dequant(codes, scales, bf16)` giving `dtype`."""
    op = getattr(torch.ops.dsv41c, f"{fmt}_dequant").default
    if _target_is(node, op) and len(node.args) >= 3 and node.args[2] == (dtype == torch.bfloat16):
        return node.args[0], node.args[1]
    return None


def _packed_rows(kv: fx.Node, dtype: torch.dtype):
    """(window, window_scales or None, comp codes or None, comp scales or None) when the rows are
    packed cache reads (module docstring), else None."""
    ring = _dequant_of(kv, "fp8", dtype)
    if ring is not None:
        return (*ring, None, None)
    if not _target_is(kv, torch.ops.aten.cat.default) or len(kv.args[0]) != 2:
        return None
    if (kv.args[1] if len(kv.args) > 1 else 0) not in (1, -2):
        return None
    first, second = kv.args[0]
    comp = _dequant_of(second, "fp4_e4m3", dtype)
    if comp is None:
        return None
    ring = _dequant_of(first, "fp8", dtype)
    if ring is not None:
        return (*ring, *comp)
    if _val(first) is None or _val(first).dtype != dtype:
        return None
    return (first, None, *comp)


def _fake(target, args: tuple) -> torch.Tensor:
    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
    try:
        with mode:
            return target(*vals)
    except (ValueError, RuntimeError) as e:     # the op's shape and dtype checks
        raise Mismatch(f"the kernel does not take these operands ({e})") from None
