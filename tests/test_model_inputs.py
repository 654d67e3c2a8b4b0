"""Bad model inputs fail at the boundary with FileNotFoundError or ConfigError whose message names the
file and the fix — never a bare traceback from inside safetensors or torch (specco/model/hf_io.py:
check_policy_dir, load_policy, load_policy_rows, check_tokenizer_fits; specco/devices.py: resolve_device).

Each bad input is written into tmp_path from a tiny policy saved by specco's own `save_policy`.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specco.cli import main
from specco.data.tokenizer import build_char_tokenizer
from specco.devices import resolve_device
from specco.model.config import ConfigError, PolicyConfig
from specco.model.hf_io import check_policy_dir, check_tokenizer_fits, load_policy, load_policy_rows, save_policy
from specco.model.policy import Policy

CFG = PolicyConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture
def policy_dir(tmp_path):
    torch.manual_seed(0)
    d = tmp_path / "policy"
    save_policy(Policy(CFG).eval(), d)
    build_char_tokenizer().save(d)  # ids 0..100: fits vocab_size 101 exactly
    return d


def _raises(exc, fn, *needles):
    with pytest.raises(exc) as e:
        fn()
    for n in needles:
        assert str(n) in str(e.value), (n, str(e.value))
    return str(e.value)


def test_good_dir_loads(policy_dir):
    assert check_policy_dir(policy_dir) == CFG
    assert check_tokenizer_fits(policy_dir) == 101
    assert load_policy(policy_dir).cfg == CFG


def test_missing_dir_config_and_weights(policy_dir, tmp_path):
    _raises(FileNotFoundError, lambda: load_policy(tmp_path / "nope"), "nope", "does not exist", "config.json")
    (policy_dir / "config.json").unlink()
    _raises(FileNotFoundError, lambda: load_policy(policy_dir), "config.json not found", "Hugging Face checkpoint")


def test_pytorch_bin_only_says_safetensors_is_required(policy_dir):
    sd = load_file(str(policy_dir / "model.safetensors"))
    (policy_dir / "model.safetensors").unlink()
    torch.save(sd, policy_dir / "pytorch_model.bin")
    _raises(FileNotFoundError, lambda: load_policy(policy_dir), "no *.safetensors", "pytorch_model.bin",
            "safe_serialization=True")


def test_config_that_is_not_json(policy_dir):
    f = policy_dir / "config.json"
    f.write_text(f.read_text().replace('"vocab_size": 101,', '"vocab_size": 101', 1))  # a missing comma
    msg = _raises(ConfigError, lambda: load_policy(policy_dir), str(f), "not valid JSON", "line ")
    assert "column" in msg


def test_unsupported_config_names_the_file(policy_dir):
    f = policy_dir / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "rope_scaling": {"rope_type": "longrope"}}))
    _raises(ConfigError, lambda: check_policy_dir(policy_dir), str(f), "rope_scaling.rope_type='longrope'")


@pytest.mark.parametrize("keep", [4, 100, -64])  # inside the length prefix, inside the header, inside the data
def test_truncated_safetensors(policy_dir, keep):
    f = policy_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep > 0 else data[:keep])
    _raises(ConfigError, lambda: load_policy(policy_dir), str(f), "re-download or re-save")


def test_corrupt_safetensors_header(policy_dir):
    f = policy_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:16] = b"\x00garbage"  # the JSON header is no longer JSON
    f.write_bytes(bytes(data))
    _raises(ConfigError, lambda: load_policy(policy_dir), str(f), "header", "re-download or re-save")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_name_tensor_and_file(policy_dir, bad):
    f = policy_dir / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    save_file(sd, str(f), metadata={"format": "pt"})
    _raises(ConfigError, lambda: load_policy(policy_dir), str(f), "'model.layers.1.mlp.down_proj.weight'",
            "NaN/inf")


def test_tokenizer_larger_than_vocab(policy_dir):
    f = policy_dir / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "vocab_size": 90}))
    _raises(ConfigError, lambda: check_tokenizer_fits(policy_dir), "tokenizer.json", "up to 100", "vocab_size=90",
            "use the tokenizer saved with the model")
    # added tokens count: one added past the base vocabulary
    f.write_text(json.dumps({**json.loads(f.read_text()), "vocab_size": 101}))
    t = policy_dir / "tokenizer.json"
    tj = json.loads(t.read_text())
    tj["added_tokens"].append({**tj["added_tokens"][0], "id": 101, "content": "<extra>"})
    t.write_text(json.dumps(tj))
    _raises(ConfigError, lambda: check_tokenizer_fits(policy_dir), "102 ids", "vocab_size=101")


def test_sharded_checkpoint_loads(policy_dir, tmp_path):
    """transformers' sharded layout: model.safetensors.index.json names each tensor's shard."""
    ref = load_policy(policy_dir)
    sd = load_file(str(policy_dir / "model.safetensors"))
    sharded = tmp_path / "sharded"
    shutil.copytree(policy_dir, sharded)
    (sharded / "model.safetensors").unlink()
    names = sorted(sd)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = load_policy(sharded)
    ids = torch.randint(0, 101, (1, 7))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    _raises(FileNotFoundError, lambda: load_policy(sharded), "model.safetensors.index.json",
            "model-00002-of-00002.safetensors", "download every shard")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type in ("cpu", "cuda")
    _raises(ConfigError, lambda: resolve_device("gpu"), "--device 'gpu'", "use auto, cpu, cuda")
    if not torch.cuda.is_available():
        _raises(ConfigError, lambda: resolve_device("cuda"), "--device cuda", "use --device cpu")
        _raises(ConfigError, lambda: resolve_device("cuda:1", option="--rollout-device"), "--rollout-device cuda:1")


@pytest.mark.parametrize("device,needle", [("gpu", "--device 'gpu'"), ("cuda", "--device cuda")])
def test_cli_generate_bad_device_is_one_line(policy_dir, capsys, device, needle):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--policy", str(policy_dir), "--prompt", "1+2=", "--device", device])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_generate_checks_the_checkpoint_first(policy_dir, capsys):
    f = policy_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(SystemExit) as e:
        main(["generate", "--policy", str(policy_dir), "--prompt", "1+2=", "--device", "cpu"])
    assert e.value.code == 2 and "model.safetensors" in capsys.readouterr().err


def _rows_load(d):
    """The row-wise (sharded) loader on one process: a meta policy materialised, then filled (hf_io.load_policy_rows)."""
    with torch.device("meta"):
        model = Policy(check_policy_dir(d))
    return load_policy_rows(d, model.to_empty(device="cpu"))


def test_row_loader_equals_whole_load_and_names_bad_tensors(policy_dir, tmp_path):
    """load_policy_rows with every row equals load_policy bit for bit; a missing tensor, a wrong shape, an
    unexpected tensor and NaN rows are ConfigErrors naming the key and the file."""
    ref, got = load_policy(policy_dir), _rows_load(policy_dir)
    for (k, a), (k2, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    f = policy_dir / "model.safetensors"
    good = load_file(str(f))
    key = "model.layers.1.self_attn.k_proj.weight"  # a part of the fused qkv_proj
    save_file({k: v for k, v in good.items() if k != key}, str(f), metadata={"format": "pt"})
    _raises(ConfigError, lambda: _rows_load(policy_dir), repr(key), "missing", "model.safetensors")
    save_file({**good, key: good[key][:-1]}, str(f), metadata={"format": "pt"})
    _raises(ConfigError, lambda: _rows_load(policy_dir), str(f), repr(key), "[15, 32]", "[16, 32]")
    save_file({**good, "model.extra.weight": good[key].clone()}, str(f), metadata={"format": "pt"})
    _raises(ConfigError, lambda: _rows_load(policy_dir), "unexpected", "model.extra.weight")
    bad = good["model.layers.0.mlp.up_proj.weight"].clone()
    bad[7, 1] = float("nan")
    save_file({**good, "model.layers.0.mlp.up_proj.weight": bad}, str(f), metadata={"format": "pt"})
    _raises(ConfigError, lambda: _rows_load(policy_dir), str(f), "'model.layers.0.mlp.up_proj.weight'", "NaN/inf")
