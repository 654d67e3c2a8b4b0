"""A test-side reference shared by the context-parallel tests: packing right-padded rows into one THD stream,
written apart from `specco.batch.pack` (which also builds positions) so the tests do not check specco's
packing against itself."""
import torch

from specco.batch import TrainBatch


def pack_rows(batch: TrainBatch, lens) -> tuple[TrainBatch, tuple[int, ...]]:
    """Right-padded rows of true lengths `lens` -> one stream (1, T) with per-token advantages, and its
    cu_seqlens."""
    cat = lambda x: torch.cat([x[b, :L] for b, L in enumerate(lens)])[None]  # noqa: E731
    adv = batch.advantages[:, None].expand(-1, max(lens))
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    return TrainBatch(tokens=cat(batch.tokens), target_mask=cat(batch.target_mask), advantages=cat(adv),
                      logp_old=cat(batch.logp_old)), tuple(cu)
