"""Provenance of post-grad nodes: which eager call a node was traced from, and the sites that
group the nodes of one call.

Inductor's post-grad graph is decomposed, constant-folded and reordered, so an eager function call
(one `hc_mixes`, one `fp4_e4m3_quant_ref`) is no longer a recognisable shape. Every node still keeps
`meta["stack_trace"]`, the eager frames it came from, and `meta["nn_module_stack"]`, the module it
ran in. A pass names the eager functions it lowers (`site_key`); the nodes whose traces reach one
call of them, in one module, from one caller line, form a `Site`. `find_sites` then gives each site
its external inputs and the nodes used outside it, which is what a rewrite needs to replace the
site by one kernel call.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch import fx

FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)')
_MODULE_PREFIX = re.compile(r"^L\['\w+'\](\.__self__)?\.?")


def frames(node: fx.Node) -> list[tuple[str, str, str, str]]:
    """The eager frames of a node, outermost first: (path, line, function, source line)."""
    return FRAME.findall(node.meta.get("stack_trace") or "")


# torch.export traces a wrapper around the model (dsv41c.export's programs), which holds it as `model`
_EXPORT_ROOTS = ("dsv41c.export.PrefillStep", "dsv41c.export.DecodeStep")


def traced_in_model(node: fx.Node) -> bool:
    """Whether the node's trace reaches the model's code. Nodes Inductor creates have none, or
    only its own frames (a pattern replacement: CUDA's online softmax), and are placed by their
    users instead (`find_sites`)."""
    return any("/dsv41c/" in path.replace("\\", "/") for path, *_ in frames(node))


def module_of(node: fx.Node) -> str:
    """The model submodule the node was traced in ("layers.0.attn"), "" for the model itself."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return ""
    path = _MODULE_PREFIX.sub("", stack[-1][0])
    root = stack[0][1]
    root = root if isinstance(root, str) else f"{root.__module__}.{root.__qualname__}"
    if root in _EXPORT_ROOTS:
        path = "" if path == "model" else path.removeprefix("model.")
    return path


def site_key(node: fx.Node, source: str, functions: Collection[str]) -> tuple | None:
    """(module path, eager frames up to the call, function) of the outermost frame of `node` that
    is one of `functions` in a file ending with `source`, else None."""
    if is_size(node) or is_shape_arithmetic(node):  # sizes belong to no call (_reread_sym_sizes)
        return None
    found = frames(node)
    for i, (path, _, func, _) in enumerate(found):
        if path.replace("\\", "/").endswith(source) and func in functions:
            return module_of(node), tuple(found[:i]), func
    return None


@dataclass(eq=False)
class Site:
    key: tuple
    nodes: set = field(default_factory=set)
    inputs: list = field(default_factory=list)     # external input nodes, in graph order
    outputs: list = field(default_factory=list)    # nodes used outside the site, in graph order

    @property
    def kind(self) -> str:
        return self.key[2]

    @property
    def module(self) -> str:
        return self.key[0]

    def describe(self) -> str:
        path, line, _, code = self.key[1][-1]
        return f"{self.kind} at {self.module or 'model'} ({path.rsplit('/', 1)[-1]}:{line} {code.strip()})"


def shape(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def is_constant(node: fx.Node) -> bool:
    """A graph constant or a scalar input (an eps), which an untraced node may read and still
    belong to a site."""
    return node.op == "get_attr" or (node.op == "placeholder" and not shape(node)) or \
        (node.op == "call_function" and not node.all_input_nodes)


def find_sites(graph: fx.Graph, key: Callable[[fx.Node], tuple | None],
               site_type: type[Site] = Site) -> list[Site]:
    """The sites of a graph (nodes grouped by `key`) with their external inputs and outputs, in
    graph order. Nodes Inductor created, whose trace does not reach the model (constants folded in,
    pattern replacements), join the site all of whose users are in it, singly or as a chain
    (`_untraced_homes`)."""
    sites: dict[tuple, Site] = {}
    owner: dict[fx.Node, Site] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            k = key(node)
            if k is not None:
                owner[node] = sites.setdefault(k, site_type(k))
    owner.update(_untraced_homes(graph, owner))
    _reread_sym_sizes(graph, owner)
    for node, site in owner.items():
        site.nodes.add(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for site in sites.values():
        ins, outs = set(), set()
        for node in site.nodes:
            ins.update(a for a in node.all_input_nodes if a not in site.nodes)
            if any(u not in site.nodes and not is_size(u) for u in node.users):  # sizes: `prune`
                outs.add(node)
        site.inputs = sorted(ins, key=order.__getitem__)
        site.outputs = sorted(outs, key=order.__getitem__)
    return sorted(sites.values(), key=lambda s: min(order[n] for n in s.nodes))


def _untraced_homes(graph: fx.Graph, owner: dict) -> dict:
    """The site each untraced node joins: the one site that all its users are in, where it reads
    only that site's nodes and constants. A chain of untraced nodes joins as a whole (each link's
    user or input may be another untraced node of the same site), so the homes are first proposed
    from the users, last node first, and then withdrawn wherever a user or an input disagrees,
    until none does."""
    home: dict = {}

    def where(n):
        return owner[n] if n in owner else home.get(n)

    for node in reversed(graph.nodes):             # users first: a chain's proposals run backwards
        if node in owner or node.op != "call_function" or not node.users or traced_in_model(node):
            continue
        homes = {where(u) for u in node.users}
        if len(homes) == 1 and None not in homes:
            home[node] = homes.pop()
    withdrawn = True
    while withdrawn:
        withdrawn = False
        for node, site in list(home.items()):
            if any(where(u) is not site for u in node.users) or \
                    any(where(a) is not site and not is_constant(a) for a in node.all_input_nodes):
                del home[node]
                withdrawn = True
    return home


def _sym_expr(v):
    return v.node.expr if isinstance(v, torch.SymInt) else None


def _reread_sym_sizes(graph: fx.Graph, owner: dict) -> None:
    """A dynamic graph from torch.export reads a symbolic size (`aten.sym_size.int`) off whichever
    tensor has it, often one inside a site, whose replacement would then keep the site alive. Such
    a read is moved to the earliest tensor outside every site with the same size, and the size node
    is never a member of a site (`site_key`); where no such tensor precedes it, it keeps reading the
    site's tensor, which is then a site output like any other."""
    seen: dict = {}                                # size expression -> (node, dim), earliest first
    for node in graph.nodes:
        if is_size(node) and node.args[0] in owner:
            expr = _sym_expr(node.meta.get("val"))
            if expr is not None and expr in seen:
                node.args = seen[expr]
        if node not in owner and isinstance(node.meta.get("val"), torch.Tensor):
            for d, size in enumerate(node.meta["val"].shape):
                expr = _sym_expr(size)
                if expr is not None:
                    seen.setdefault(expr, (node, d))


def is_size(node: fx.Node) -> bool:
    """A symbolic size read (`aten.sym_size.int`), which keeps no site alive (see `prune`)."""
    return node.op == "call_function" and node.target is torch.ops.aten.sym_size.int


def is_shape_arithmetic(node: fx.Node) -> bool:
    """Arithmetic on symbolic sizes (e.g. batch x length for a flatten), which Dynamo traces at the
    line that needed it but shares with every later view of the same shape."""
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def prune(graph: fx.Graph) -> None:
    """Dead-code elimination after a rewrite. A replaced node that only symbolic size reads still
    use (a site's outputs exclude them) has its sizes re-read from the earliest preceding tensor of
    the same size, often the kernel call's output, so that it goes too."""
    live = {n for n in graph.nodes if n.op == "output"}
    for node in reversed(graph.nodes):            # nodes something other than a size read needs
        if node in live or node.op != "call_function" or node.is_impure():
            live.add(node)
            if not is_size(node):
                live.update(node.all_input_nodes)
    seen: dict = {}
    for node in graph.nodes:
        if is_size(node) and node.args[0] not in live:
            found = seen.get(_sym_expr(node.meta.get("val")))
            if found is not None:
                node.args = found
        if node in live and isinstance(node.meta.get("val"), torch.Tensor):
            for d, size in enumerate(node.meta["val"].shape):
                if _sym_expr(size) is not None:
                    seen.setdefault(_sym_expr(size), (node, d))
    graph.eliminate_dead_code()
