"""lower_mhc: the eager mHC ops of every sublayer become one single-pass TileLang kernel call.

The eager model writes mHC (spec §5) as dozens of small aten ops per site: the coefficient mixes
(a GEMM, an RMS statistic, sigmoids and an unrolled 20-step Sinkhorn), the collapse of the streams
with the delayed pre mix, and the expand (residual update). In the post-grad graph those ops are
decomposed, constant-folded and reordered, so the pass finds them by provenance rather than by
shape: every node keeps the stack trace of the eager line it came from, and the nodes traced from
one call of `dsv41c.mhc.hc_mixes` / `hc_collapse` / `hc_expand` form one site. Nodes Inductor
created without a trace (eps constants folded in) join the site all of whose users are in it.
Each site is then checked structurally (its external inputs and outputs have the shapes the
equations need) and lowered:

    expand E(y, res, post, comb) whose output feeds mixes M and collapse C(., w)
        -> mhc_post_pre(y, res, post, comb, w, fn, scale, base)      (the steady state)
    E feeding only C (the head's input)          -> mhc_post_collapse(y, res, post, comb, w)
    E feeding neither (an Engram layer follows)  -> mhc_post_collapse(y, res, post, comb, post),
                                                    its collapse output unused
    M and C reading the same streams h (a layer's first site, the site after an Engram layer,
    the first layer's identity mix)              -> mhc_pre(h, fn, scale, base, w)

Before (one FFN site, simplified):              After:
    r  = float(res); t = mul(comb', r) ...          h_new, x, pre', post', comb' =
    h_new = convert(add(mul(post', y), sum(t)))         dsv41c.mhc_post_pre(y, res, post, comb,
    s  = float(view(h_new)); mm(s, fn^T) ...                               w, fn, scale, base)
    ... 20 x (sum, add, div) ...  -> pre', post', comb'
    x  = convert(sum(mul(w', float(h_new))))

fn, scale and base come from the bound model (`bind`), named by the site's module path and the
sublayer its trace names ("attn"/"ffn"); they enter the graph as compile-time constants. A site
the pass cannot lower is an error naming it, in strict mode and out of it: a half-lowered graph
would silently lose the single pass over the streams.
"""
from __future__ import annotations

import operator
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx
from torch._inductor.pattern_matcher import stable_topological_sort

from dsv41c.passes import provenance
from dsv41c.passes.manager import ModelPass, PassError, PassStats
from dsv41c.passes.provenance import shape as _shape
from dsv41c.passes.provenance import site_key

aten = torch.ops.aten
MHC_FILE = "dsv41c/mhc.py"
KINDS = ("hc_mixes", "hc_collapse", "hc_expand")
_SUBLAYER = re.compile(r'mixes\("(\w+)"')


def _site_key(node: fx.Node) -> tuple | None:
    """(module path, eager frames up to the mHC function, that function) of a node traced from
    dsv41c/mhc.py, else None."""
    return site_key(node, MHC_FILE, KINDS)


@dataclass(eq=False)
class Site(provenance.Site):
    @property
    def sublayer(self) -> str | None:
        for *_, code in reversed(self.key[1]):  # the caller's line: self.mixes("attn", h)
            m = _SUBLAYER.search(code)
            if m:
                return m.group(1)
        return None


def find_sites(graph: fx.Graph) -> list[Site]:
    """The mHC sites of a graph with their external inputs and outputs, in graph order."""
    return provenance.find_sites(graph, _site_key, Site)


def _stored(node: fx.Node) -> fx.Node:
    """The tensor as the model stores it, looking through upcasts of the whole tensor. With bf16
    streams the eager ops read `h.float()`; Inductor's CSE may leave one such upcast, traced from
    another site, as this site's input. The kernels take the stored dtype and compute in fp32."""
    while node.target in (torch.ops.prims.convert_element_type.default, aten._to_copy.default) \
            and isinstance(node.args[0], fx.Node) and _shape(node.args[0]) == _shape(node) \
            and node.meta["val"].dtype == torch.float32:
        node = node.args[0]
    return node


class LowerMHC(ModelPass):
    name = "lower_mhc"
    kernel_modules = ("mhc",)

    def apply(self, graph: fx.Graph) -> PassStats:
        self.bound_model()
        stats = PassStats(self.name)
        sites = find_sites(graph)
        if not sites:
            return stats
        rewrite = _Rewrite(graph, self.model, sites)
        for site in sites:
            if site.kind == "hc_expand":
                stats.details.append(rewrite.expand_site(site))
        for site in sites:
            if site.kind == "hc_mixes" and site not in rewrite.done:
                detail = rewrite.pre_site(site)
                if detail:
                    stats.details.append(detail)
        left = [s for s in sites if s not in rewrite.done]
        if left:
            raise PassError(f"lower_mhc: {len(left)} mHC site(s) left unmatched, first: {left[0].describe()}")
        # a kernel call sits after its last input; Inductor's reordering may have placed a reader
        # of an mHC output before that point, so restore a topological order (stable otherwise)
        stable_topological_sort(graph)
        provenance.prune(graph)
        remaining = [n for n in graph.nodes if n.op == "call_function" and _site_key(n) is not None]
        if remaining:
            raise PassError(f"lower_mhc: {len(remaining)} eager mHC op(s) still in the graph, first "
                            f"{remaining[0].name}")
        stats.matches = len(stats.details)
        stats.nodes_removed = sum(len(s.nodes) for s in sites)
        stats.nodes_added = rewrite.added
        return stats


class _Rewrite:
    """The lowering of one graph: site structure checks, kernel calls, and the substitution of
    replaced nodes (a later site may name a node an earlier rewrite has replaced)."""

    def __init__(self, graph: fx.Graph, model, sites: list[Site]):
        self.graph, self.model, self.sites = graph, model, sites
        self.m, self.d = model.args.hc_mult, model.args.dim
        self.readers: dict[fx.Node, list[Site]] = defaultdict(list)
        for site in sites:
            for node in site.inputs:
                self.readers[node].append(site)
        self.expand_inputs = {n for s in sites if s.kind == "hc_expand" for n in s.inputs}
        self.mhc_nodes = set().union(*(s.nodes for s in sites))
        self.subst: dict[fx.Node, fx.Node] = {}
        self.done: set[Site] = set()
        self.added = 0
        self.fake_mode = next(n.meta["val"].fake_mode for s in sites for n in s.inputs
                              if isinstance(n.meta.get("val"), torch.Tensor))

    def expand_site(self, site: Site) -> str:
        y, res, post, comb = self._expand_inputs(site)
        (h_new,) = self._outputs(site, 1)
        readers = [s for s in self.readers[h_new] if s not in self.done]
        mixes = next((s for s in readers if s.kind == "hc_mixes"), None)
        collapse = next((s for s in readers if s.kind == "hc_collapse"), None)
        self.done.add(site)
        if mixes is not None and collapse is not None:
            w = self._collapse_weight(collapse, h_new)
            outs = self._call("mhc_post_pre", (y, res, post, comb, w, *self._constants(mixes)), mixes)
            self._replace(h_new, outs[0])
            self._replace(self._outputs(collapse, 1)[0], outs[1])
            self._replace_mixes(mixes, outs[2:])
            self.done.update((mixes, collapse))
            return f"post_pre at {site.module}"
        # the head's input (collapse only), or streams an Engram layer rewrites next (neither):
        # there the collapse weight is a stand-in and the collapse output is left unused
        w = self._collapse_weight(collapse, h_new) if collapse is not None else post
        outs = self._call("mhc_post_collapse", (y, res, post, comb, w), None)
        self._replace(h_new, outs[0])
        if collapse is not None:
            self._replace(self._outputs(collapse, 1)[0], outs[1])
            self.done.add(collapse)
        return f"post_collapse at {site.module or 'model'}" + ("" if collapse is not None else " (no collapse)")

    def pre_site(self, mixes: Site) -> str | None:
        h = _stored(self._by_shape(mixes, [n for n in mixes.inputs if n.op != "get_attr"], (self.m, self.d),
                                   "streams"))
        collapse = next((s for s in self.readers[h] if s.kind == "hc_collapse" and s not in self.done), None)
        if collapse is None:
            return None
        w = self._collapse_weight(collapse, h)
        outs = self._call("mhc_pre", (h, *self._constants(mixes), w), mixes)
        self._replace(self._outputs(collapse, 1)[0], outs[0])
        self._replace_mixes(mixes, outs[1:])
        self.done.update((mixes, collapse))
        return f"pre at {mixes.module}"

    # ------------------------------------------------------------------ site structure
    def _outputs(self, site: Site, count: int) -> list[fx.Node]:
        """The site's outputs, less upcasts of its input that only other mHC sites read (`_stored`:
        those sites take the stored tensor instead)."""
        outs = [n for n in site.outputs
                if _stored(n) is n or not all(u in self.mhc_nodes for u in n.users)]
        if len(outs) != count:
            raise PassError(f"lower_mhc: {site.describe()} has {len(outs)} outputs, expected {count}")
        return outs

    @staticmethod
    def _by_shape(site: Site, nodes, tail: tuple, what: str, rank: int | None = None) -> fx.Node:
        found = [n for n in nodes if len(_shape(n)) >= len(tail) and _shape(n)[-len(tail):] == tail
                 and (rank is None or len(_shape(n)) == rank)]
        if len(found) != 1:
            raise PassError(f"lower_mhc: {site.describe()}: expected one {what} input of shape [..., "
                            f"{', '.join(map(str, tail))}], found {len(found)}")
        return found[0]

    def _expand_inputs(self, site: Site):
        m, d = self.m, self.d
        tensors = [n for n in site.inputs if n.op != "get_attr" and _shape(n)]
        res = _stored(self._by_shape(site, tensors, (m, d), "streams"))
        rank = len(_shape(res))
        comb = self._by_shape(site, tensors, (m, m), "comb", rank)
        y = _stored(self._by_shape(site, tensors, (d,), "sublayer output", rank - 1))
        post = self._by_shape(site, tensors, (m,), "post", rank - 1)
        return y, res, post, comb

    def _collapse_weight(self, collapse: Site, h: fx.Node) -> fx.Node:
        others = [n for n in collapse.inputs if n is not h and n.op != "get_attr" and _shape(n)]
        return self._by_shape(collapse, others, (self.m,), "pre mix")

    def _constants(self, mixes: Site) -> list[fx.Node]:
        """fn, scale, base of the mixes site, as compile-time constants of the graph module."""
        block = self.model.get_submodule(mixes.module)
        sub = mixes.sublayer
        if block is None or sub is None or not hasattr(block, f"hc_{sub}_fn"):
            raise PassError(f"lower_mhc: cannot tell which parameters belong to {mixes.describe()}")
        gm, nodes = self.graph.owning_module, []
        for part in ("fn", "scale", "base"):
            value = getattr(block, f"hc_{sub}_{part}").detach().contiguous()
            name = f"_dsv41c_mhc_{mixes.module.replace('.', '_')}_{sub}_{part}"
            if not hasattr(gm, name):
                gm.register_buffer(name, value)
            with self.graph.inserting_before(next(iter(self.graph.nodes))):
                node = self.graph.get_attr(name)
            node.meta["val"] = self.fake_mode.from_tensor(value, static_shapes=True)
            nodes.append(node)
            self.added += 1
        return nodes

    # ------------------------------------------------------------------ rewriting
    def _call(self, op: str, args, mixes: Site | None) -> list[fx.Node]:
        """The kernel call after its last input, on token-flattened operands ([T, ...]: the kernels
        take one token dim), and its outputs reshaped back to the model's leading dims."""
        target = getattr(torch.ops.dsv41c, op).default
        args = [self.subst.get(a, a) for a in args]
        kwargs = dict(self.model.get_submodule(mixes.module).hc) if mixes is not None else {}
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        ref = max((a for a in args if _shape(a)[-2:] == (self.m, self.d)), key=order.__getitem__)
        lead = len(_shape(ref)) - 2
        with self.graph.inserting_before(max(args, key=order.__getitem__).next):  # keeps creation order
            flat = [a if a.op == "get_attr" else self._node(aten.reshape.default, (a, [-1, *_shape(a)[lead:]]))
                    for a in args]
            call = self._node(target, tuple(flat), kwargs)
            sizes = [dim if isinstance(dim, int) else self._node(aten.sym_size.int, (ref, i))
                     for i, dim in enumerate(_shape(ref)[:lead])]
            outs = []
            for i, val in enumerate(call.meta["val"]):
                item = self._node(operator.getitem, (call, i))
                outs.append(self._node(aten.reshape.default, (item, [*sizes, *val.shape[1:]])))
        return outs

    def _node(self, target, args, kwargs=None) -> fx.Node:
        """A call_function node with its fake value (inserted at the current insertion point)."""
        node = self.graph.call_function(target, args, kwargs or {})
        fake = [a.meta["val"] if isinstance(a, fx.Node) else
                [x.meta["val"] if isinstance(x, fx.Node) else x for x in a] if isinstance(a, list) else a
                for a in args]
        with self.fake_mode:
            node.meta["val"] = target(*fake, **(kwargs or {}))
        self.added += 1
        return node

    def _last(self, nodes: list[fx.Node]) -> list[fx.Node]:
        """Of several [.., m, m] outputs, the Sinkhorn result is the last one computed; the others
        are intermediates that Inductor lets another mHC site read, and that site is lowered too
        (the check for remaining eager mHC ops holds if it is not)."""
        if len(nodes) < 2:
            return nodes
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        last = max(nodes, key=order.__getitem__)
        others_in_sites = all(u in self.mhc_nodes for n in nodes if n is not last for u in n.users)
        return [last] if others_in_sites else nodes

    def _replace(self, old: fx.Node, new: fx.Node) -> None:
        a, b = old.meta["val"], new.meta["val"]
        if a.dtype == torch.float32 and b.dtype == torch.bfloat16:
            # Inductor may fold the model's round trip through bf16 (`x.to(bf16).float()` into
            # the next norm) so that the site's output is the fp32 value before the rounding;
            # torch 2.11's `pointless_convert` does. The kernel's output is the rounded value the
            # model stores; the upcast restores the model's numerics.
            with self.graph.inserting_after(new):
                new = self._node(torch.ops.prims.convert_element_type.default, (new, torch.float32))
            b = new.meta["val"]
        if a.dim() != b.dim() or a.shape[-1] != b.shape[-1] or a.dtype != b.dtype:
            raise PassError(f"lower_mhc: replacement of {old.name} is {tuple(b.shape)} {b.dtype}, "
                            f"expected {tuple(a.shape)} {a.dtype}")
        old.replace_all_uses_with(new)
        self.subst[old] = new

    def _replace_mixes(self, mixes: Site, outs) -> None:
        """Map the mixes site's outputs onto the kernel's (pre, post, comb): comb is the [.., m, m]
        one; of the two [.., m], post is the one an expand site reads (else the product)."""
        m = self.m
        comb = self._last([n for n in mixes.outputs if _shape(n)[-2:] == (m, m)])
        vec = [n for n in mixes.outputs if n not in comb and _shape(n)[-1:] == (m,)]
        post = [n for n in vec if n in self.expand_inputs]
        if len(post) != 1:  # no expand reads it here: post = 2 sigmoid(.), pre = sigmoid(.) + eps
            post = [n for n in vec if n.target is aten.mul.Tensor]
        if len(comb) != 1 or len(vec) != 2 or len(post) != 1:
            found = ", ".join(f"{n.name} ({n.target}, {_shape(n)}, read by {[u.name for u in n.users]})"
                              for n in mixes.outputs)
            raise PassError(f"lower_mhc: {mixes.describe()} does not output one pre, post and comb; "
                            f"its outputs: {found}")
        pre = next(n for n in vec if n is not post[0])
        for old, new in zip((pre, post[0], comb[0]), outs, strict=True):
            self._replace(old, new)
