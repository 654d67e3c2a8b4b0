"""CLI helpers shared by the export tests (no tests here)."""
from specco.cli import main


def generate_texts(capsys, policy_dir, draft_dirs, max_new_tokens: int, k: int) -> list[str]:
    """What `specco generate` prints for the prompt "3+4=" with each draft directory in turn (CPU, greedy)."""
    texts = []
    for d in draft_dirs:
        main(["generate", "--policy", str(policy_dir), "--draft", str(d), "--prompt", "3+4=",
              "--max-new-tokens", str(max_new_tokens), "--k", str(k), "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    return texts
