"""lm-evaluation-harness against a live `kvserve serve` of the demo model, as the README
runs it: `lm_eval --model local-completions` with the demo tokenizer, on two tasks
defined here from local JSON files (no hub): a multiple-choice loglikelihood task and a
`generate_until` task. Its loglikelihoods must equal transformers' log-softmax on the
same tokens, and its generations the server's own greedy completions.

The server runs with a small `--max-num-batched-tokens`, so the longer prompts are
prefilled (and scored) over several chunks, next to the other prompts of each batch."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from loadtest.spawn import python_path
from tests.live_server import wait_ready

ROOT = Path(__file__).resolve().parent.parent
# the dev extra installs it; a machine given the runtime alone (a lent GPU) has not
# (found, not imported: importing it costs every collecting worker seconds)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm_eval is not installed (pip install -e .[dev])")
TOL = 1e-3

# target_delimiter "" below: each choice carries its own leading space, if any.
LOGLIKELIHOOD_DOCS = [
    {"context": "import os\nprint(os.path.", "choices": ["join", "banana", "walk"], "label": 0},
    {"context": "import sys\nprint(sys.", "choices": ["argv", "path", "stdout.write"],
     "label": 0},
    {"context": "The os module provides a portable way of using operating system "
                "dependent functionality. If you just want to read or write a file see",
     "choices": [" open()", " the tempfile module", " cheese"], "label": 0},
    {"context": "def read(path):\n    with open(path) as f:\n        return f.",
     "choices": ["read()", "close", "write(path)"], "label": 0},
    {"context": "Return a list of the words in the string, using sep as the delimiter "
                "string. If maxsplit is given, at most maxsplit splits are done",
     "choices": [".", " (thus, the list will have at most maxsplit+1 elements).", "!"],
     "label": 1},
]
GENERATE_DOCS = [
    {"question": "import sys\nprint(sys.", "answer": "argv)"},
    {"question": "The list type", "answer": " is a mutable sequence"},
    {"question": "class Point:\n    def __init__(self, x, y):\n", "answer": "        self.x = x"},
]


def _tasks(root: Path) -> Path:
    """Two lm-eval tasks over local JSON files (`dataset_path: json`)."""
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs in (("ll", LOGLIKELIHOOD_DOCS), ("gen", GENERATE_DOCS)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n"
              f"    test: {tasks}/{{name}}.jsonl\ntest_split: test\n")
    (tasks / "kvserve_ll.yaml").write_text(
        "task: kvserve_ll\n" + common.format(name="ll")
        + 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        + 'target_delimiter: ""\n' + _metric("acc"))
    (tasks / "kvserve_gen.yaml").write_text(
        "task: kvserve_gen\n" + common.format(name="gen")
        + 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
        + 'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n  until: ["\\n\\n"]\n'
        + "  max_gen_toks: 16\n" + _metric("exact_match"))
    return tasks


def _metric(name: str) -> str:
    return (f"metric_list:\n  - metric: {name}\n    aggregation: mean\n"
            f"    higher_is_better: true\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(out: Path, task: str) -> list[dict[str, Any]]:
    [path] = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of (context, continuation) into tokens (TemplateLM._encode_pair,
    local-completions' tok_encode without special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


@pytest.mark.slow
def test_lm_eval_local_completions_matches_transformers(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    log = open(log_path, "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--port", str(port),
         "--max-num-batched-tokens", "24"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(proc, url, log_path)
        tasks = _tasks(tmp_path)
        out = tmp_path / "out"
        # The README's command, with the tasks above (no hub: datasets and the hub offline)
        args = ["--model", "local-completions", "--model_args",
                f"base_url={url}/v1/completions,model={DEMO_MODEL_NAME},"
                f"tokenizer={DEMO_MODEL_DIR},tokenizer_backend=huggingface,max_length=1024",
                "--tasks", "kvserve_ll,kvserve_gen", "--include_path", str(tasks),
                "--batch_size", "4", "--output_path", str(out), "--log_samples"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, "-m", "lm_eval", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

        tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
        hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
        worst, scored, greedy = 0.0, 0, 0
        samples = _samples(out, "kvserve_ll")
        assert len(samples) == len(LOGLIKELIHOOD_DOCS)
        for s in samples:
            for i, (ll, is_greedy) in enumerate(s["filtered_resps"]):
                args_i = s["arguments"][f"gen_args_{i}"]
                ctx, cont = _encode_pair(tok, args_i["arg_0"], args_i["arg_1"])
                with torch.no_grad():
                    logits = hf(torch.tensor([ctx + cont])).logits[0].float()
                logp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
                target = torch.tensor(cont)
                ref = logp.gather(1, target[:, None]).sum().item()
                worst = max(worst, abs(float(ll) - ref))
                ref_greedy = bool((logp.argmax(dim=-1) == target).all())
                assert (is_greedy == "True") == ref_greedy, (args_i, ll, ref)
                scored += 1
                greedy += ref_greedy
        print(f"lm-eval loglikelihoods vs transformers: {scored} continuations, "
              f"max |diff| {worst:.2e}")
        assert worst < TOL, worst
        assert greedy >= 1  # "argv" after `print(sys.`: the greedy path is exercised

        gens = _samples(out, "kvserve_gen")
        assert len(gens) == len(GENERATE_DOCS)
        with httpx.Client(base_url=url, timeout=60) as c:
            for s in gens:
                prompt = tok(s["arguments"]["gen_args_0"]["arg_0"],
                             add_special_tokens=False).input_ids
                r = c.post("/v1/completions", json={
                    "model": DEMO_MODEL_NAME, "prompt": prompt, "max_tokens": 16,
                    "temperature": 0, "stop": ["\n\n", tok.decode([tok.eos_token_id])]})
                assert r.status_code == 200, r.text
                assert s["resps"][0][0] == r.json()["choices"][0]["text"]
        results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        assert 0.0 <= results["kvserve_ll"]["acc,none"] <= 1.0
        assert 0.0 <= results["kvserve_gen"]["exact_match,none"] <= 1.0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
