"""Helpers shared by tests (no tests here): the demo config, the CLI's generated texts."""
from pathlib import Path

from specco.cli import main

# configs/demo.toml: the from-scratch tiny model's job (SFT on chain_sum, three arms), the base of tests that
# run the pipeline; the run config's own defaults suit a pretrained policy
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def generate_texts(capsys, policy_dir, draft_dirs, max_new_tokens: int, k: int) -> list[str]:
    """What `specco generate` prints for the prompt "3+4=" with each draft directory in turn (CPU, greedy)."""
    texts = []
    for d in draft_dirs:
        main(["generate", "--policy", str(policy_dir), "--draft", str(d), "--prompt", "3+4=",
              "--max-new-tokens", str(max_new_tokens), "--k", str(k), "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    return texts


def save_char_tokenizer(path, vocab_size: int) -> None:
    """The character tokenizer (ids 0..100), saved into policy directory `path` with the ids >= vocab_size
    dropped, so it fits a test policy whose vocabulary is smaller (`specco generate` refuses a tokenizer
    with ids past the model's vocab_size: hf_io.check_tokenizer_fits). The dropped characters are the
    last printable ones (whitespace), which the tests' prompts do not use."""
    import json
    from pathlib import Path

    from specco.data.tokenizer import build_char_tokenizer
    build_char_tokenizer().save(path)
    f = Path(path) / "tokenizer.json"
    tj = json.loads(f.read_text())
    tj["model"]["vocab"] = {t: i for t, i in tj["model"]["vocab"].items() if i < vocab_size}
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < vocab_size]
    f.write_text(json.dumps(tj))
