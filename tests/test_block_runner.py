"""Runner wiring of the block drafters: save/load round trip, the warm start's initial draft, the demo end to end."""
import json

import pytest
import torch

from specco.config import DraftSpec
from specco.model.config import ConfigError, PolicyConfig
from specco.model.dflash import BlockDraft, BlockDraftConfig
from specco.model.policy import Policy
from specco.runner.warmstart import initial_draft, load_draft_dir, mask_token_id

pytestmark = pytest.mark.e2e


def _policy():
    torch.manual_seed(0)
    return Policy(PolicyConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                               num_kv_heads=2))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_draft_save_load_round_trip(tmp_path, kind):
    d = BlockDraft(BlockDraftConfig.for_policy(_policy().cfg, kind, gamma=3, mask_id=49, markov_rank=4))
    d.save(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporary behind
    assert json.loads((tmp_path / "draft_config.json").read_text())["architecture"] == "specco.BlockDraft"
    e = load_draft_dir(tmp_path)
    assert isinstance(e, BlockDraft) and e.cfg == d.cfg
    assert e.state_dict().keys() == d.state_dict().keys()
    for k, v in d.state_dict().items():
        assert torch.equal(v, e.state_dict()[k]), k


def test_initial_draft_block_kinds():
    policy = _policy()
    tokens = torch.randint(0, 40, (8, 12))  # ids 40..49 never occur: the mask is the highest of them
    assert mask_token_id(tokens, 50) == 49
    assert mask_token_id(torch.arange(50)[None], 50, fallback=3) == 3
    with pytest.raises(ConfigError, match="reserved"):
        mask_token_id(torch.arange(50)[None], 50)
    d = initial_draft(policy, tokens, DraftSpec(kind="dspark"), gamma=4)
    assert isinstance(d, BlockDraft) and (d.kind, d.cfg.gamma, d.cfg.mask_id) == ("dspark", 4, 49)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        initial_draft(policy, tokens, DraftSpec(kind="dflash", draft_vocab_size=10), gamma=3)


@pytest.mark.slow
def test_demo_with_dflash(tmp_path):
    from specco.cli import main
    out = tmp_path / "run"
    main(["demo", "--quiet", "--out", str(out), "policy.hidden_size=32", "policy.num_layers=2", "draft.aux_layer_ids=[]",
          "policy.num_heads=2", "policy.num_kv_heads=1", "policy.intermediate_size=64", "sft.steps=10",
          "train.warm_start_steps=3", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
          "rollout.max_new_tokens=8", "data.eval_size=4", "draft.kind=dflash"])
    assert isinstance(load_draft_dir(out / "warm_draft"), BlockDraft)
    rows = [json.loads(x) for x in (out / "arms" / "cotrained" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(1.0 <= r["draft/tau_prob"] <= 4.0 and "draft/accept_slot2" in r for r in rows)
    assert set(json.loads((out / "summary.json").read_text())["arms"]) == {"none", "frozen", "cotrained"}
