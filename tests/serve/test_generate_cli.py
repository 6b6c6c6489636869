"""`k3 generate` streams through the serving engine: greedy output equals the plain reference loop
(k3.serve.generate.generate_tokens over K3Model.forward with an InferenceState), EOS ends it, text is complete."""

from typer.testing import CliRunner

from k3.cli.main import app
from k3.serve.generate import generate_tokens


def test_generate_cli_greedy_equals_reference_loop(ckpt, model_tok):
    model, tok = model_tok
    prompt = "def main():\n"
    ids = tok.encode(prompt, add_bos=True)
    ref = []
    for t in generate_tokens(model, ids, max_tokens=12, temperature=0, stop_ids=(tok.eos_id,)):
        if t == tok.eos_id:
            break
        ref.append(t)
    res = CliRunner().invoke(app, ["generate", str(ckpt), "--prompt", prompt, "--max-tokens", "12",
                                   "--temperature", "0", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert res.stdout == prompt + tok.decode(ref) + "\n"
    assert f"[{len(ref)} tokens in" in res.output  # stderr is mixed into output by CliRunner


def test_generate_cli_seeded_sampling_is_reproducible(ckpt):
    args = ["generate", str(ckpt), "--prompt", "import ", "--max-tokens", "10", "--temperature", "0.8", "--top-k",
            "20", "--seed", "3", "--device", "cpu"]
    a, b = CliRunner().invoke(app, args), CliRunner().invoke(app, args)
    assert a.exit_code == b.exit_code == 0, a.output
    assert a.stdout == b.stdout and a.stdout.startswith("import ")


def test_generate_cli_dtype(ckpt):
    """--dtype bfloat16 runs the engine in bf16 (k3 serve's dtype policy); an unknown dtype is a usage error naming
    the choices."""
    args = ["generate", str(ckpt), "--prompt", "import ", "--max-tokens", "4", "--temperature", "0", "--device", "cpu"]
    res = CliRunner().invoke(app, args + ["--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("import ") and "[" in res.output
    bad = CliRunner().invoke(app, args + ["--dtype", "fp8"])
    assert bad.exit_code == 2 and "bfloat16" in bad.output
