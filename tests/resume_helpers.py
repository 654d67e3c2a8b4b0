"""Test-side check shared by the resume tests (GRPO, PPO): two runs end in bit-identical weights."""
import torch

from specco.train.checkpoint import latest_checkpoint, load_checkpoint


def assert_same_final_weights(dir_a, dir_b, parts=("policy", "draft")) -> tuple[dict, dict]:
    """The newest checkpoints under dir_a/ckpt and dir_b/ckpt hold bit-identical tensors in `parts`; returns
    both checkpoints (for further checks of their other parts)."""
    sa = load_checkpoint(latest_checkpoint(dir_a / "ckpt"), restore_rng=False)
    sb = load_checkpoint(latest_checkpoint(dir_b / "ckpt"), restore_rng=False)
    for part in parts:
        assert set(sa[part]) == set(sb[part]), part
        for k in sa[part]:
            assert torch.equal(sa[part][k], sb[part][k]), (part, k)
    return sa, sb
