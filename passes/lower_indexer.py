"""lower_indexer: every eager indexer call (spec §6.5, §6.9) becomes the TileLang indexer kernels.

The eager `dsv41c.attention.Indexer.forward` scores every compressed entry for every query
(`index_scores`: an einsum, relu, the head weights and a sum over heads), masks the entries a
prefill query cannot see, runs the candidate funnel (`candidate_mask`: block maxima, the newest
block pinned, top blocks, an entry mask) at the candidate source or applies the published mask at
later index sources, then takes the top-k, sorts it, marks invisible entries -1 and adds the
window offset. In the post-grad graph that is a few dozen aten ops per layer, with the [B,S,H,n]
per-head scores materialised. The pass finds them by provenance: the nodes traced from one call of
`Indexer.forward`, from its `index_scores` line to its end (the visibility `compress_len` line
excluded), form a site (`provenance.py`). Layers that score the same keys share some of that work
after Inductor's CSE (the invisible mask), so a site's operands are found through the nodes of
other sites, as in lower_sparse_attn. Operands: q [B,S,H,d], the keys [B,n,d], the head weights w
[B,S,H], and, structurally from the last line, visible_len [S] and the window offset:

    idx = int(where(ge(sorted, view(visible_len)), -1, add(sorted, offset)))

The keys must be a packed cache read, `dsv41c.mxfp4_dequant(codes, scales, bf16=True)` as the `fp4_kv`
pass leaves it; the kernel then reads the MXFP4 codes and scales directly and the dequantised keys
disappear. Per site:

    candidate source:
        sc, bm = dsv41c.index_scores(q, codes, scales, w, vl, None, n=n, block_max=True)
        keep   = dsv41c.candidate_blocks(bm, vl, topk_blocks=Indexer.topk_blocks)
        idx    = dsv41c.index_topk(sc, vl, keep if Indexer.topk_blocks > Indexer.topk else None,
                                   k=k, offset=offset)
    later index source (its candidate mask is the lowered `keep` of the source):
        sc, _  = dsv41c.index_scores(q, codes, scales, w, vl, keep, n=n, block_max=False)
        idx    = dsv41c.index_topk(sc, vl, keep, k=k, offset=offset)
    no funnel: as the later source without `keep`

The top-k takes block flags where they keep every block it could select from (index_topk's
contract): at a later source, the flags the scores were masked with; at the candidate source, its
own funnel's flags when the funnel keeps more blocks than the top-k takes entries (the k largest
scores then lie in the top k + 1 blocks by block maximum, the pinned one counted; bench.json keeps
2048 blocks for a top-512). The CUDA top-k then reads only the kept blocks' scores.

vl is visible_len as int32; the scoring kernel gets it only where the eager site masks invisible
entries before the top-k (the prefill, whose `if state.is_prefill` block the site contains): a
decode step scores every cached entry and only marks the invisible ones -1 afterwards, as
index_topk does. The candidate source's entry mask, if anything outside the lowered sites still
reads it, is rebuilt from `keep` (each block flag repeated over its block's entries). A funnel's
block size other than the released 8 (tiny's is 4) goes to the ops as `block=`: the C builds take
any size, the CUDA builds 8 only.

Ties: the kernels give a tie to the lower index; the eager bf16 path uses torch.topk's order,
which the spec leaves to the implementation (§6.5), so compiled and eager may pick different
members of a tie. The scores themselves are bit-identical on MXFP4-quantised queries (kv_quant).

A site the kernels cannot take (fp32: the kernels are bf16 only; keys that are not a packed cache
read; on CUDA, a funnel block size other than 8; a candidate mask from a site left as torch ops)
stays as torch ops: it is reported in the stats and warned about, and strict mode makes it an
error naming the site.
"""
from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap

import torch
from torch import fx
from torch._inductor.pattern_matcher import stable_topological_sort

from dsv41c.passes import provenance
from dsv41c.passes.manager import ModelPass, PassError, PassStats
from dsv41c.passes.provenance import Site, frames, module_of

aten, prims = torch.ops.aten, torch.ops.prims
ATTENTION_FILE = "dsv41c/attention.py"
_VIEWS = (aten.reshape.default, aten.view.default, aten.unsqueeze.default, aten.expand.default,
          aten.squeeze.dim, aten.squeeze.default)


class Mismatch(Exception):
    """A site the kernels do not take (reported, left as torch ops)."""


@functools.cache
def _forward_lines() -> tuple[frozenset[int], frozenset[int]]:
    """(site lines, prefill-mask lines) of `Indexer.forward` in its file: the statements from the
    one that calls `index_scores` to the end, less the one that calls `compress_len`; and those of
    the `if state.is_prefill:` block among them."""
    from dsv41c.attention import Indexer

    source, start = inspect.getsourcelines(Indexer.forward)
    body = ast.parse(textwrap.dedent("".join(source))).body[0].body
    site, prefill, on = set(), set(), False
    for stmt in body:
        calls = {n.func.id for n in ast.walk(stmt) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        on = on or "index_scores" in calls
        if not on or "compress_len" in calls:
            continue
        lines = set(range(start + stmt.lineno - 1, start + stmt.end_lineno))
        site |= lines
        if isinstance(stmt, ast.If) and "is_prefill" in ast.unparse(stmt.test):
            prefill |= lines
    if not site:
        raise PassError("lower_indexer: Indexer.forward has no `index_scores` call")
    return frozenset(site), frozenset(prefill)


def _indexer_frame(node: fx.Node) -> int | None:
    """Index of the frame of `node` that is a site line of Indexer.forward, else None."""
    site_lines = _forward_lines()[0]
    for i, (path, line, func, _) in enumerate(frames(node)):
        if func == "forward" and int(line) in site_lines and path.replace("\\", "/").endswith(ATTENTION_FILE):
            return i
    return None


def _key(node: fx.Node) -> tuple | None:
    if node.target is aten.sym_size.int:          # a size read belongs to no call (provenance)
        return None
    i = _indexer_frame(node)
    return None if i is None else (module_of(node), tuple(frames(node)[:i]), "indexer")


def _val(node):
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _target_is(node, op) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is op


def _in_function(site: Site, func: str) -> bool:
    return any(f[2] == func for n in site.nodes for f in frames(n))


def _masks_invisible(site: Site) -> bool:
    """The site holds the prefill's masking of invisible entries (traced from that block)."""
    prefill = _forward_lines()[1]
    for node in site.nodes:
        i = _indexer_frame(node)
        if i is not None and int(frames(node)[i][1]) in prefill:
            return True
    return False


class LowerIndexer(ModelPass):
    name = "lower_indexer"
    kernel_modules = ("indexer", "quant")   # the scores, top-k and funnel; the keys' dequantise

    def apply(self, graph: fx.Graph) -> PassStats:
        self.bound_model()
        stats = PassStats(self.name)
        sites = provenance.find_sites(graph, _key)
        rewrite = _Rewrite(graph, self.model, sites)
        missed = []
        for site in sites:
            try:
                stats.details.append(rewrite.site(site))
            except Mismatch as e:
                missed.append(f"{site.describe()}: {e}")
        stats.matches = len(stats.details)
        stats.nodes_added = rewrite.added
        if rewrite.added:
            stable_topological_sort(graph)       # a kernel call sits after its last operand
        before = len(graph.nodes)
        provenance.prune(graph)
        stats.nodes_removed = before - len(graph.nodes)
        self.report_left(stats, missed, "indexer site(s)")
        return stats


class _Rewrite:
    def __init__(self, graph: fx.Graph, model, sites: list[Site]):
        self.graph, self.model, self.sites = graph, model, sites
        self.owner = {n: s for s in sites for n in s.nodes}
        self.blocks: dict[fx.Node, fx.Node] = {}    # candidate entry mask -> its kernel block flags
        self.funnels = {s for s in sites if _in_function(s, "candidate_mask")}
        self.lowered: set[Site] = set()
        self.added = 0

    # ------------------------------------------------------------------ one site
    def site(self, site: Site) -> str:
        from dsv41c.tilelang_kernels.indexer import BLOCK, funnel_keeps_topk

        out = self._output(site)
        q, keys, w, cand = self._operands(site, _val(out))
        vl, offset = self._last_line(out)
        qv = _val(q)
        if qv.dtype != torch.bfloat16 or _val(keys).dtype != torch.bfloat16 or _val(w).dtype != torch.bfloat16:
            raise Mismatch(f"the indexer kernels take bf16 only; q is {qv.dtype}")
        packed = _dequant_of(keys)
        if packed is None:
            raise Mismatch("the index keys are not a packed MXFP4 cache read (the fp4_kv pass runs first)")
        codes, scales = packed
        module = self.model.get_submodule(site.module) if site.module else self.model
        funnel = site in self.funnels
        # entries a candidate block: the site's own funnel's, or that of the candidate_blocks call its
        # flags come from (its `block` argument, absent for the ops' default)
        if funnel:
            block = getattr(module, "block_size", None)
        else:
            block = BLOCK if cand is None else cand.kwargs.get("block", BLOCK)
        if funnel and (not isinstance(block, int) or block < 1):
            raise Mismatch(f"candidate block size {block}")
        if funnel and block != BLOCK and qv.device.type != "cpu":
            raise Mismatch(f"candidate block size {block}: the CUDA kernels take blocks of {BLOCK}")
        bk = {} if block == BLOCK else {"block": block}  # (the ops' default is the released 8)
        mask_out = self._mask_output(site, _val(out)) if funnel else None
        n = self._sym(_val(keys).shape[1], "n")
        k = self._sym(_val(out).shape[-1], "k")
        first = min((o for o in (out, mask_out) if o is not None), key=self._order().__getitem__)
        with self.graph.inserting_before(first):
            vl32 = self._node(prims.convert_element_type.default, (vl, torch.int32))
            scores = self._node(torch.ops.dsv41c.index_scores.default,
                                (q, codes, scales, w, vl32 if _masks_invisible(site) else None, cand),
                                {"n": n, "block_max": funnel, **bk})
            sc = self._node(operator.getitem, (scores, 0))
            if funnel:
                bm = self._node(operator.getitem, (scores, 1))
                keep = self._node(torch.ops.dsv41c.candidate_blocks.default, (bm, vl32),
                                  {"topk_blocks": module.topk_blocks, **bk})
                mask = self._node(aten.repeat_interleave.self_int, (keep, block, -1))
                if str(_val(mask).shape[-1]) != str(_val(mask_out).shape[-1]):
                    mask = self._node(aten.slice.Tensor, (mask, 2, 0, self._sym(_val(mask_out).shape[-1], "n")))
                if str(_val(mask).shape) != str(_val(mask_out).shape):
                    raise Mismatch(f"the candidate mask is {tuple(_val(mask_out).shape)}, the kernel's "
                                   f"{tuple(_val(mask).shape)}")
                self.blocks[mask] = keep
            # the blocks the top-k reads (module docstring): the source's own funnel when it keeps more
            # blocks than the top-k takes entries, the candidates at a later source
            flags = keep if funnel and funnel_keeps_topk(module.topk_blocks, module.topk) else cand
            idx = self._node(torch.ops.dsv41c.index_topk.default, (sc, vl32, flags),
                             {"k": k, "offset": offset, **(bk if flags is not None else {})})
        if str(_val(idx).shape) != str(_val(out).shape):
            raise Mismatch(f"index_topk gives {tuple(_val(idx).shape)}, the site {tuple(_val(out).shape)}")
        out.replace_all_uses_with(idx)
        if funnel:
            mask_out.replace_all_uses_with(mask)
        self.lowered.add(site)
        kernels = "index_scores" + (" + candidate_blocks" if funnel else "") + " + index_topk"
        return f"{kernels} at {site.module or 'model'}" + (" (candidates)" if cand is not None else "")

    # ------------------------------------------------------------------ site structure
    def _order(self) -> dict:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def _output(self, site: Site) -> fx.Node:
        """The top-k list: the site's one int32 [B,S,k] value read outside the sites."""
        outs = [n for n in site.outputs if any(u not in self.owner for u in n.users)
                and _val(n) is not None and _val(n).dim() == 3 and _val(n).dtype == torch.int32]
        if len(outs) != 1:
            raise Mismatch(f"expected one int32 [B,S,k] output, found {len(outs)}")
        return outs[0]

    def _mask_output(self, site: Site, out: torch.Tensor) -> fx.Node:
        """The candidate source's entry mask: its one bool [B,S,n] value read outside it."""
        outs = [o for o in site.outputs if _val(o) is not None and _val(o).dtype == torch.bool
                and _val(o).dim() == 3 and str(tuple(_val(o).shape[:2])) == str(tuple(out.shape[:2]))
                and any(u not in site.nodes for u in o.users)]
        if len(outs) != 1:
            raise Mismatch(f"expected one bool [B,S,n] candidate mask output, found {len(outs)}")
        return outs[0]

    def _operands(self, site: Site, out: torch.Tensor):
        """(q, keys, w, candidate block flags or None): the site's external tensor inputs, looking
        through nodes of other sites (shared by CSE) but not past a lowered candidate mask."""
        found, cands, seen = [], [], set()
        todo = [a for n in site.nodes for a in n.all_input_nodes if a not in site.nodes]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in self.blocks:
                cands.append(self.blocks[node])
            elif node in self.owner:
                other = self.owner[node]
                if other in self.funnels and other not in self.lowered:
                    raise Mismatch(f"its candidate mask comes from a site left as torch ops ({other.describe()})")
                todo.extend(node.all_input_nodes)
            elif _val(node) is not None and _val(node).dim() > 0 and _val(node).is_floating_point():
                found.append(node)
        b, s = out.shape[:2]

        def shp(n):
            return tuple(_val(n).shape)
        qs = [n for n in found if _val(n).dim() == 4 and shp(n)[:2] == (b, s)]
        if len(qs) != 1:
            raise Mismatch(f"expected one q [B,S,H,d] operand, found {len(qs)}")
        q = qs[0]
        h, d = shp(q)[2:]
        ws = [n for n in found if shp(n) == (b, s, h)]
        keys = [n for n in found if _val(n).dim() == 3 and shp(n)[0] == b and shp(n)[2] == d and n not in ws]
        if len(ws) != 1 or len(keys) != 1:
            raise Mismatch(f"expected one w [B,S,H] and one keys [B,n,d] operand, found {len(ws)} and {len(keys)}")
        if len(set(cands)) > 1:
            raise Mismatch(f"{len(set(cands))} candidate masks")
        return q, keys[0], ws[0], (cands[0] if cands else None)

    def _last_line(self, out: fx.Node):
        """(visible_len [S], offset) of idx = int(where(idx >= visible_len, -1, idx + offset))."""
        where = out.args[0] if _target_is(out, prims.convert_element_type.default) else out
        if not _target_is(where, aten.where.self) or not isinstance(where.args[0], fx.Node):
            raise Mismatch("the top-k list is not where(idx >= visible_len, -1, idx + offset)")
        ge, add = where.args[0], where.args[2]
        if not (_target_is(ge, aten.ge.Tensor) and _target_is(add, aten.add.Tensor)):
            raise Mismatch("the top-k list is not where(idx >= visible_len, -1, idx + offset)")
        vl = ge.args[1]
        while isinstance(vl, fx.Node) and vl.op == "call_function" and vl.target in _VIEWS:
            vl = vl.args[0]
        s = _val(out).shape[1]
        if _val(vl) is None or _val(vl).dim() != 1 or str(_val(vl).shape[0]) != str(s) or \
                _val(vl).is_floating_point():
            raise Mismatch("visible_len is not an integer [S] tensor")
        offset = add.args[1]
        if isinstance(offset, fx.Node) and not isinstance(offset.meta.get("val"), (int, torch.SymInt)):
            raise Mismatch("the window offset is not a scalar")
        return vl, offset

    def _sym(self, value, what: str):
        """An int, or the graph node that computes the symbolic size `value`."""
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = value.node.expr
        for node in self.graph.nodes:
            v = node.meta.get("val")
            if isinstance(v, torch.SymInt) and v.node.expr == expr:
                return node
        raise Mismatch(f"no node computes the symbolic {what} = {expr}")

    # ------------------------------------------------------------------ rewriting
    def _node(self, target, args, kwargs=None) -> fx.Node:
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        vals = [_fake_arg(a) for a in args]
        kw = {key: _fake_arg(v) for key, v in (kwargs or {}).items()}
        if target is operator.getitem:
            node.meta["val"] = vals[0][vals[1]]
            self.added += 1
            return node
        mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
        try:
            with mode:
                node.meta["val"] = target(*vals, **kw)
        except (ValueError, RuntimeError) as e:      # the ops' shape and dtype checks
            self.graph.erase_node(node)
            raise Mismatch(f"the kernel does not take these operands ({e})") from None
        self.added += 1
        return node


def _fake_arg(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _dequant_of(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(codes, scales) if node is `dsv41c.mxfp4_dequant(codes, scales, bf16=True)`."""
    op = torch.ops.dsv41c.mxfp4_dequant.default
    if _target_is(node, op) and len(node.args) >= 3 and node.args[2] is True:
        return node.args[0], node.args[1]
    return None
