"""fp4_kv: the compiled model keeps its KV caches in the packed deployment formats (spec §10.5),
quantised on write and dequantised on read by the TileLang codec kernels.

    window ring        FP8 E4M3, one UE8M0 scale per 32      528 B per 512-value entry
    compressed KV      FP4 E2M1, one E4M3 scale per 16       288 B per 512-value entry
    index keys         MXFP4 (E2M1, one UE8M0 per 32)         68 B per 128-value entry

Binding the pass (`dsv41c.compile` does it) switches the model's `ModelCache` to packed storage,
so every `RowStore.write` traces the torch quantiser (`<fmt>_quant_ref`) followed by the stores of
its codes and scales into uint8 buffers, and every `RowStore.read` traces the slices of those
buffers followed by `<fmt>_dequant_ref`. The eager model class is unchanged; the model needs
kv_quant=True, whose fake quantisers are the numerics the packed bytes carry. The pass finds each
codec call by provenance (the nodes traced from one call of a ref inside dsv41c/cache.py form a
site, see `provenance.py`) and replaces it by one kernel call, bit-identical to the ref:

Before (a decode-step window write and read, simplified):
    y  = <fp8_fake_quant of kv: amax, scale bits, div, clamp, to e4m3, mul>
    b  = reshape(y, [.., 2, 32]); a = amax(abs(b)); s = <UE8M0 bits of a/448> ...
    c  = view(reshape(to_e4m3(clamp(b / s))), uint8); e = reshape(to_uint8(s_bits))
    codes' = index_put(codes, [None, slot], c); scales' = index_put(scales, [None, slot], e)
    rows = reshape(float(view(codes', e4m3)) * unsqueeze(<float of scales'>), [.., 64])
After:
    c, e   = dsv41c.fp8_quant(kv)
    codes' = index_put(codes, [None, slot], c); scales' = index_put(scales, [None, slot], e)
    rows   = dsv41c.fp8_dequant(codes', scales', bf16=False)

The window's and index keys' quantiser input is the fake-quantised vector (attention applies
kv_quant before those writes; compressed KV entries reach a packed store un-quantised).
When that input comes from the fake quantiser of the same format and block (possibly through row
slices: the window keeps the last W rows), the kernel reads the fake quantiser's input instead:
dequant(quant(x)) equals fake_quant(x) bit for bit (quant.py), so the cache then reads back exactly
what the plain kv_quant cache holds. Quantising the fake-quantised vector again would not: FP4
with E4M3 scales is not idempotent (a block whose scale is an E4M3 subnormal re-derives a smaller
scale and saturates its largest value), so the re-quantised read-back can differ from the plain
cache. The fake quantiser stays wherever something else reads it (the prefill attends over the new
window rows directly); elsewhere it becomes dead code.

Layers that read the same cache rows (a kv source and its Reindex and Reuse layers) trace one read
each, but Inductor's CSE has already shared their decoding, so the later reads start from the first
one's intermediate values. Such reads are rewritten together, into one dequantise call.

Stats: one match per rewritten read or write; `counts` tallies (direction, format) over all graphs.
A codec site left as torch ops (its format not in `formats`, or operands the kernels do not take)
is still correct, so it is reported in the stats and warned about; strict mode makes it an error
naming the site.
"""
from __future__ import annotations

import operator
from collections import Counter

import torch
from torch import fx

from dsv41c.passes import provenance
from dsv41c.passes.manager import GraphPass, PassError, PassStats
from dsv41c.passes.provenance import Site, is_constant, is_size, shape

aten = torch.ops.aten
QUANT_FILE = "dsv41c/quant.py"
CACHE_FILE = "dsv41c/cache.py"
FORMATS = ("fp8", "fp4_e4m3", "mxfp4")
BLOCKS = {"fp8": 32, "fp4_e4m3": 16, "mxfp4": 32}
REFS = {f"{fmt}_{way}_ref": (fmt, "write" if way == "quant" else "read")
        for fmt in FORMATS for way in ("quant", "dequant")}
FAKE_QUANTS = {"fp8_fake_quant": "fp8", "fp4_e4m3_fake_quant": "fp4_e4m3", "fp4_ue8m0_fake_quant": "mxfp4"}


def _key(node: fx.Node) -> tuple | None:
    """Site key of a node traced from a fake quantiser, or from a codec ref called by a RowStore
    (other uses of the refs, e.g. weight formats, are not cache traffic)."""
    key = provenance.site_key(node, QUANT_FILE, REFS.keys() | FAKE_QUANTS.keys())
    if key is None or key[2] in FAKE_QUANTS:
        return key
    callers = key[1]
    return key if callers and callers[-1][0].replace("\\", "/").endswith(CACHE_FILE) else None


def is_cache_codec(node: fx.Node) -> bool:
    """A node traced from a RowStore's quantise or dequantise ref."""
    key = _key(node) if node.op == "call_function" else None
    return key is not None and key[2] in REFS


def describe(site: Site) -> str:
    """'fp8 write at layers.0.attn (attention.py:120 cache.window.write(...))': the RowStore call."""
    fmt, direction = REFS[site.kind]
    callers = site.key[1]
    path, line, _, code = callers[-2] if len(callers) > 1 else callers[-1]
    return f"{fmt} {direction} at {site.module or 'model'} ({path.rsplit('/', 1)[-1]}:{line} {code.strip()})"


class Mismatch(Exception):
    """A codec site whose inputs or outputs are not what the kernel call replaces."""


class PackedKV(GraphPass):
    name = "fp4_kv"
    kernel_modules = ("quant",)

    def __init__(self, formats=FORMATS, **options):
        unknown = sorted(set(formats) - set(FORMATS))
        if unknown:
            raise PassError(f"fp4_kv: unknown format {unknown[0]!r}; expected some of {FORMATS}")
        super().__init__(formats=sorted(formats), **options)
        self.formats = frozenset(formats)
        self.counts: Counter[tuple[str, str]] = Counter()

    def bind(self, model: torch.nn.Module) -> None:
        """Switch the model's caches to packed storage (they start empty; the compiled callable
        shares them with the model)."""
        from dsv41c.cache import ModelCache
        if not getattr(model, "kv_quant", False):
            raise PassError("fp4_kv: the model must be built with kv_quant=True (the packed caches carry "
                            "the KV quantisation numerics); found kv_quant=False")
        if model.cache.storage != "packed":
            with torch.device(model.device):
                model.cache = ModelCache(model.args, model.plan, model.dtype, "packed")

    def apply(self, graph: fx.Graph) -> PassStats:
        stats = PassStats(self.name)
        sites = provenance.find_sites(graph, _key)
        owner = {n: s for s in sites for n in s.nodes}
        rewrite = _Rewrite(graph, owner)
        missed = []
        for members in _units(sites, owner):
            fmt, direction = REFS[members[0].kind]
            try:
                if fmt not in self.formats:
                    raise Mismatch(f"format {fmt} not in this pass's formats")
                if direction == "write":
                    rewrite.write(members[0], fmt)
                else:
                    rewrite.read(_merged(graph, members), fmt, len(members))
            except Mismatch as e:
                missed += [f"{describe(m)}: {e}" for m in members]
                continue
            stats.details += [describe(m) for m in members]
            self.counts[direction, fmt] += len(members)
        stats.matches = len(stats.details)
        provenance.prune(graph)
        left = [n for n in graph.nodes if is_cache_codec(n) and n not in rewrite.operands]
        if left and not missed:
            missed.append(f"{len(left)} codec op(s) outside any site, first {left[0].name}")
        self.report_left(stats, missed, "cache codec site(s)")
        stats.nodes_removed = sum(len(s.nodes) for s in sites if s.kind in REFS) - len(left)
        stats.nodes_added = rewrite.added
        return stats


class _Rewrite:
    """Kernel calls in place of codec sites, each placed before the site's first output. A site is
    checked against the kernel's fake outputs before the graph is touched."""

    def __init__(self, graph: fx.Graph, owner: dict[fx.Node, Site]):
        self.graph, self.owner = graph, owner
        self.operands: set[fx.Node] = set()   # site nodes kept as kernel operands (row slices)
        self.added = 0

    def write(self, site: Site, fmt: str) -> None:
        (x,) = self._tensors(site.inputs, 1, "input")
        outs = self._tensors(site.outputs, 2, "output")
        x = self._unquantised(x, fmt, before=outs[0])
        target = getattr(torch.ops.dsv41c, f"{fmt}_quant").default
        fakes = self._fake(target, (x,))
        olds = [next((n for n in outs if _same(n.meta["val"], f)), None) for f in fakes]
        if None in olds or olds[0] is olds[1]:
            raise Mismatch(f"outputs {[_desc(n.meta['val']) for n in outs]} are not the kernel's "
                           f"{[_desc(f) for f in fakes]}")
        call = self._call(target, (x,), fakes, before=outs[0])
        with self.graph.inserting_after(call):
            for i, old in enumerate(olds):
                item = self.graph.call_function(operator.getitem, (call, i))
                item.meta["val"] = fakes[i]
                old.replace_all_uses_with(item)

    def _unquantised(self, x: fx.Node, fmt: str, before: fx.Node) -> fx.Node:
        """quant(fq(v)) -> quant(v), also through row slices (the window keeps the last W rows):
        the fake quantiser works per block of one row, so row slices commute with it."""
        rows = []
        while x.target is aten.slice.Tensor and x not in self.owner and x.args[1] % len(shape(x)) < len(shape(x)) - 1:
            rows.append(x)
            x = x.args[0]
        source = self.owner.get(x)
        if source is None or FAKE_QUANTS.get(source.kind) != fmt or _block(source) != BLOCKS[fmt]:
            return rows[0] if rows else x
        inputs = [n for n in source.inputs if _is_data(n)]
        if len(inputs) != 1 or (rows and str(shape(inputs[0])) != str(shape(x))):
            return rows[0] if rows else x
        v = inputs[0]
        for row in reversed(rows):
            args = (v, *row.args[1:])
            v = self._call(aten.slice.Tensor, args, self._fake(aten.slice.Tensor, args), before, kernel=False)
        return v

    def read(self, site: Site, fmt: str, reads: int) -> None:
        """One dequantise call for `reads` reads of the same rows (one site, or several merged)."""
        ins = [_sliced(site, n) for n in self._tensors(site.inputs, 2, "input")]
        codes, scales = sorted(ins, key=lambda n: -shape(n)[-1])          # codes are the wider
        outs = self._tensors(site.outputs, reads, "output")
        target = getattr(torch.ops.dsv41c, f"{fmt}_dequant").default
        args = (codes, scales, outs[0].meta["val"].dtype == torch.bfloat16)
        fake = self._fake(target, args)
        if not all(_same(out.meta["val"], fake) for out in outs):
            raise Mismatch(f"outputs {[_desc(n.meta['val']) for n in outs]} are not the kernel's {_desc(fake)}")
        call = self._call(target, args, fake, before=outs[0])
        for out in outs:
            out.replace_all_uses_with(call)
        for n in ins:                              # the row slices kept as operands, whole chains
            while n in site.nodes and n.target is aten.slice.Tensor:
                self.operands.add(n)
                n = n.args[0]

    def _tensors(self, nodes, count: int, what: str) -> list[fx.Node]:
        found = [n for n in nodes if _is_data(n)]
        if len(found) != count:
            raise Mismatch(f"{len(found)} tensor {what}s, expected {count}")
        return found

    @staticmethod
    def _fake(target, args: tuple):
        fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        try:
            with fake[0].fake_mode:
                return target(*fake)
        except (ValueError, RuntimeError) as e:     # the op's shape checks
            raise Mismatch(f"the kernel does not take these operands ({e})") from None

    def _call(self, target, args: tuple, fake, before: fx.Node, kernel: bool = True) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args)
        node.meta["val"] = fake
        self.added += kernel
        return node


def _is_data(node: fx.Node) -> bool:
    """A tensor computed from tensors or passed in; not a constant, nor a factory (`full` of a
    symbolic size), which Inductor shares between sites."""
    return isinstance(node.meta.get("val"), torch.Tensor) and not is_constant(node) and (
        node.op == "placeholder" or any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes))


def _units(sites: list[Site], owner: dict[fx.Node, Site]) -> list[list[Site]]:
    """The codec sites to rewrite together: each write alone; reads of the same rows by several
    layers (Reindex and Reuse layers read their source's cache) as one unit, since Inductor's CSE
    shares their decoding, so that the later reads take the first one's intermediate values."""
    codec = [s for s in sites if s.kind in REFS]
    parent = {s: s for s in codec if REFS[s.kind][1] == "read"}

    def root(s: Site) -> Site:
        while parent[s] is not s:
            s = parent[s]
        return s

    for site in parent:
        for node in site.inputs:
            other = owner.get(node)
            if other is not site and other in parent and other.kind == site.kind and _is_data(node):
                parent[root(site)] = root(other)
    reads: dict[Site, list[Site]] = {}
    for site in parent:
        reads.setdefault(root(site), []).append(site)
    return [[s] for s in codec if s not in parent] + list(reads.values())


def _merged(graph: fx.Graph, members: list[Site]) -> Site:
    """One site of the union of `members`' nodes, with its external inputs and outputs."""
    if len(members) == 1:
        return members[0]
    merged = Site(members[0].key, set().union(*(m.nodes for m in members)))
    order = {n: i for i, n in enumerate(graph.nodes)}
    ins = {a for n in merged.nodes for a in n.all_input_nodes if a not in merged.nodes}
    outs = {n for n in merged.nodes if any(u not in merged.nodes and not is_size(u) for u in n.users)}
    merged.inputs, merged.outputs = sorted(ins, key=order.__getitem__), sorted(outs, key=order.__getitem__)
    return merged


def _sliced(site: Site, node: fx.Node) -> fx.Node:
    """The rows a read site uses of a cache buffer. The read slices the buffer before the ref, but
    after a write in the same graph functionalisation replays that slice on the updated buffer at
    its first use, so it carries the ref's trace and sits inside the site."""
    while True:
        users = [u for u in node.users if u in site.nodes]
        if len(users) != 1 or users[0].target is not aten.slice.Tensor:
            return node
        node = users[0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and str(tuple(a.shape)) == str(tuple(b.shape))


def _desc(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)}"


def _block(site: Site) -> int | None:
    """The scale block of a fake-quantiser site: the width its block amax reduces."""
    widths = {shape(n.args[0])[-1] for n in site.nodes if n.target is aten.amax.default}
    return widths.pop() if len(widths) == 1 else None
