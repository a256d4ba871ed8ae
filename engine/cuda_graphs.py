"""Decode steps as captured CUDA graphs, one per batch size of a ladder.

A step whose chunks are one token each, B of them, replays the graph of the smallest captured
batch G >= B: its inputs are written into the runner's step buffers (the addresses the graph
was captured with), rows [B, G) as padding (engine.step_inputs), and the graph computes the
final hidden states of all G rows, from which the runner takes the rows that sample. The whole
forward pass is inside the graph: GEMMs, the per-token LoRA kernels (grid fixed by G, rows
without an adapter skipped as NO_SLOT; they read each adapter's weights through the offset
and rank tables of adapters.layout, allocated once with the pool, so loading an adapter only
rewrites their contents) and paged attention (grid fixed by G; KV lengths read on the device).
With LoRA on, each batch is captured twice: with the LoRA kernels, and without them for steps
where no token has an adapter (an eager step then runs none either; in a graph the kernels
would still launch their whole grid to find nothing to do: 1.3 ms of a 12.8 ms Llama-3-8B step
at batch 64 on an H100, docs/gpu-runs.md). Graphs share one memory pool, captured largest
first so smaller ones reuse it.

Memory: the pool holds about one forward pass of the largest batch; `ModelRunner` measures
that before sizing the KV pool and counts it in the KV budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_batches(max_batch: int) -> tuple[int, ...]:
    """The ladder: 1, 2, 4, then every 4 up to 32, every 8 up to 64, every 16 up to 128, every
    32 up to 512, cut at `max_batch` (itself included): past batch 8, padding is at most a
    quarter of a graph's rows. Up to 256: 22 graphs."""
    cap = min(max_batch, MAX_GRAPH_BATCH)
    ladder = [1, 2, *range(4, 32, 4), *range(32, 64, 8), *range(64, 128, 16)]
    ladder += range(128, MAX_GRAPH_BATCH + 1, 32)
    return tuple(sorted({b for b in ladder if b < cap} | {cap}))


@dataclass(frozen=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor
    """[G, hidden], written by every replay."""


class DecodeGraphs:
    """The captured graphs, by (batch size, with LoRA kernels)."""

    def __init__(self, graphs: dict[tuple[int, bool], _Graph]):
        self._graphs = graphs
        self.batches = tuple(sorted({batch for batch, _ in graphs}))
        self.replays = {False: 0, True: 0}
        """Replays so far without and with the LoRA kernels."""

    @classmethod
    def capture(
        cls,
        batches: Sequence[int],
        variants: Sequence[bool],
        prepare_padding: Callable[[int, bool], None],
        forward: Callable[[int], torch.Tensor],
    ) -> DecodeGraphs:
        """Capture `forward(G)` (the model over the step buffers' first G rows) for each G and
        each variant (with LoRA or not), after `prepare_padding(G, variant)` filled those rows
        with padding and one eager run compiled its kernels and made its constants."""
        graphs: dict[tuple[int, bool], _Graph] = {}
        pool = None
        for batch in sorted(batches, reverse=True):
            for with_lora in variants:
                prepare_padding(batch, with_lora)
                forward(batch)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = forward(batch)
                pool = graph.pool()
                graphs[batch, with_lora] = _Graph(graph, hidden)
        torch.cuda.synchronize()
        log.info("captured decode graphs for batches %s, variants %s", sorted(batches), variants)
        return cls(graphs)

    def batch_for(self, num_seqs: int) -> int | None:
        """The graph batch a step of `num_seqs` one-token chunks replays; None past the
        largest."""
        return next((b for b in self.batches if b >= num_seqs), None)

    def replay(self, batch: int, with_lora: bool) -> torch.Tensor:
        """Run the graph over the step buffers' current contents: hidden states [G, hidden],
        valid until the next replay of any graph."""
        g = self._graphs[batch, with_lora]
        g.graph.replay()
        self.replays[with_lora] += 1
        return g.hidden
