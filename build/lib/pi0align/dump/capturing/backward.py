"""The torch backend's backward capture, which observes autograd without changing it.

`register_full_backward_hook` wraps tensors in extra identity nodes, which reorders gradient
accumulation and changes gradients at rounding level. Here nothing is added to the graph: hooks
go on the autograd nodes a call created, and report the gradients those nodes receive (flowing
into the call's outputs) and produce (flowing out of the call to its inputs).

`csrc/capture_extension.cpp` holds the same `input_edges` and `watch` for the native backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import get_gradient_edge

# A call made of more autograd nodes than this (a composite) keeps only its output gradients.
_MAX_NODES = 16

# (role, arg_index, gradient), called with torch functions disabled: its own tensor work is not captured
Sink = Callable[[str, int, torch.Tensor], None]
_quiet = torch._C.DisableTorchFunction


def input_edges(inputs: list[torch.Tensor]) -> list[tuple[int, object]] | None:
    """(arg_index, gradient edge) of the inputs that require grad (None: none does); take them
    before an in-place call."""
    return [(i, get_gradient_edge(x)) for i, x in enumerate(inputs) if x.requires_grad] or None


def watch(outputs: list[torch.Tensor], edges: list[tuple[int, object]] | None, sink: Sink) -> None:
    """Report each output's incoming gradient and, where the call's nodes lead straight to its
    inputs (`edges`, from `input_edges`), each input's outgoing gradient, to `sink` during backward."""
    edges = edges or []
    targets: dict[tuple, list[int]] = {}  # an input passed twice (x * x) has one edge, two args
    for i, edge in edges:
        targets.setdefault((id(edge.node), edge.output_nr), []).append(i)
    target_nodes = {id(edge.node) for _, edge in edges}
    per_node: dict[int, list] = {}  # id(node) -> [node, [(output_nr, arg)], [(next index, arg)]]
    for arg, out in enumerate(outputs):
        node = out.grad_fn
        if node is None or (id(node), out.output_nr) in targets or id(node) in target_nodes:
            continue  # no gradient, or an input handed back unchanged: not this call's node
        per_node.setdefault(id(node), [node, [], []])[1].append((out.output_nr, arg))
    if not per_node:
        return
    frontier = [entry[0] for entry in per_node.values()] if edges else []
    seen = set(per_node)
    while frontier and len(seen) <= _MAX_NODES:
        node = frontier.pop()
        used: dict[tuple, int] = {}
        for j, (following, nr) in enumerate(node.next_functions):
            if following is None:
                continue
            key = (id(following), nr)
            args = targets.get(key)
            if args is not None:
                k = used[key] = used.get(key, -1) + 1
                if k < len(args):
                    per_node.setdefault(id(node), [node, [], []])[2].append((j, args[k]))
            elif id(following) not in target_nodes and id(following) not in seen:
                seen.add(id(following))
                frontier.append(following)
    if len(seen) > _MAX_NODES:  # a composite: its input edges are not all found, report none
        per_node = {key: [node, outs, []] for key, (node, outs, _) in per_node.items() if outs}
    for node, outs, ins in per_node.values():
        node.register_hook(_node_hook(outs, ins, sink))


def _node_hook(outs: list, ins: list, sink: Sink):
    def hook(grad_inputs, grad_outputs):
        with _quiet():
            for nr, arg in outs:
                if grad_outputs[nr] is not None:
                    sink("grad_output", arg, grad_outputs[nr])
            for j, arg in ins:
                if grad_inputs[j] is not None:
                    sink("grad_input", arg, grad_inputs[j])

    return hook


def sink(records, name: str, forward_id: int, open_backward: Callable[[int], int]) -> Sink:
    """Records each gradient of the forward call `forward_id` (named `name`) into `records` (the
    step's TorchRecords) until its step has ended; the call's backward row opens, through
    `open_backward(forward_id)`, at the first gradient."""
    backward_id = None

    def record(role: str, arg_index: int, grad: torch.Tensor) -> None:
        nonlocal backward_id
        if records.closed:
            return  # a graph kept past its step (retain_graph) or past stop()
        if backward_id is None:
            backward_id = open_backward(forward_id)
        records.record(backward_id, name, role, arg_index, [grad])

    return record


def watch_tensor_grads(tensors: list[torch.Tensor], role: str, sink: Sink) -> None:
    """Report the full gradient of each tensor that requires grad (module inputs)."""
    for arg, tensor in enumerate(tensors):
        if tensor.requires_grad:
            tensor.register_hook(_tensor_hook(role, arg, sink))


def _tensor_hook(role: str, arg: int, sink: Sink):
    def hook(grad):
        with _quiet():
            sink(role, arg, grad)

    return hook
