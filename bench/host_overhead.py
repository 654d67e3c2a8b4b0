"""The host work after an RL step's generate call: the rows' completion ids and texts (what the rewards and
the training pairs read), old way against new, on engine-like outputs on the device.

The old way read the device tokens element by element (`Tokenizer.decode` iterated the row tensor: one
device sync per token), which the long workload's RL runs logged as 2-4 s of `time/other` per step at 256
rows x ~1,000 tokens. The new way (`runner.rollouts.completions`) copies the tokens to the host once.

    python bench/host_overhead.py --device cuda [--rows 256] [--mean-len 1000] [--max-len 2150]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import write_results  # noqa: E402

from specco.data.tokenizer import build_char_tokenizer  # noqa: E402
from specco.runner.rollouts import completions, rollout_pairs  # noqa: E402


def old_way(tok, out, prompts):
    """The code before the fix: per-row slices of the device tensors, each id read on its own."""
    N = out.tokens.shape[0]
    texts = [tok.backend.decode(list(map(int, out.tokens[i, :int(out.lengths[i])])), skip_special_tokens=True)
             for i in range(N)]
    pairs = [(prompts[r // out.group_size], out.tokens[r, :int(out.lengths[r])].tolist()) for r in range(N)]
    lps = [out.logprobs[i, :int(out.lengths[i])].float().cpu().tolist() for i in range(N)]
    return texts, pairs, lps


def new_way(tok, out, prompts):
    comps = completions(out)
    logprobs = out.logprobs.float().cpu()
    return ([tok.decode(c) for c in comps], rollout_pairs(prompts, out, comps),
            [logprobs[i, :len(c)].tolist() for i, c in enumerate(comps)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--mean-len", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=2150)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(0)
    lengths = torch.poisson(torch.full((a.rows,), float(a.mean_len)), generator=g).clamp(1, a.max_len).long()
    out = SimpleNamespace(tokens=torch.randint(4, tok.vocab_size, (a.rows, a.max_len), generator=g).to(dev),
                          lengths=lengths.to(dev), logprobs=torch.randn(a.rows, a.max_len, generator=g).to(dev),
                          group_size=8)
    prompts = [[1, 2, 3]] * (a.rows // 8 + 1)
    res = {"rows": a.rows, "tokens": int(lengths.sum())}
    for name, fn in (("old", old_way), ("new", new_way)):
        fn(tok, out, prompts)  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = fn(tok, out, prompts)
        res[f"{name}_s"] = time.perf_counter() - t0
        res[name] = got
    same = res.pop("old") == res.pop("new")
    assert same, "the two ways disagree"
    print(f"{a.rows} rows, {res['tokens']} tokens: old {res['old_s']:.3f} s, new {res['new_s']:.3f} s "
          f"({res['old_s'] / res['new_s']:.0f}x), same output")
    write_results(res, "host_overhead", dev, a.out)


if __name__ == "__main__":
    main()
