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


def module_of(node: fx.Node) -> str:
    """The model submodule the node was traced in ("layers.0.attn"), "" for the model itself."""
    stack = node.meta.get("nn_module_stack") or {}
    return _MODULE_PREFIX.sub("", list(stack.values())[-1][0]) if stack else ""


def site_key(node: fx.Node, source: str, functions: Collection[str]) -> tuple | None:
    """(module path, eager frames up to the call, function) of the outermost frame of `node` that
    is one of `functions` in a file ending with `source`, else None."""
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
    graph order. Nodes Inductor created without a trace (constants folded in) join the site all of
    whose users are in it."""
    sites: dict[tuple, Site] = {}
    owner: dict[fx.Node, Site] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            k = key(node)
            if k is not None:
                owner[node] = sites.setdefault(k, site_type(k))
    changed = True
    while changed:                                # untraced nodes whose users all lie in one site
        changed = False
        for node in reversed(graph.nodes):
            if node in owner or node.op != "call_function" or not node.users:
                continue
            homes = {owner.get(u) for u in node.users}
            if len(homes) != 1 or None in homes or node.meta.get("stack_trace"):
                continue
            home = homes.pop()
            if all(owner.get(a) is home or is_constant(a) for a in node.all_input_nodes):
                owner[node] = home
                changed = True
    for node, site in owner.items():
        site.nodes.add(node)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for site in sites.values():
        ins, outs = set(), set()
        for node in site.nodes:
            ins.update(a for a in node.all_input_nodes if a not in site.nodes)
            if any(u not in site.nodes for u in node.users):
                outs.add(node)
        site.inputs = sorted(ins, key=order.__getitem__)
        site.outputs = sorted(outs, key=order.__getitem__)
    return sorted(sites.values(), key=lambda s: min(order[n] for n in s.nodes))
