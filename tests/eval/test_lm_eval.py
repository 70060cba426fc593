"""lm-evaluation-harness adapter on a tiny local multiple-choice task (offline: json dataset + task YAML)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm.cli.eval import main
from llm.eval.lm_eval_adapter import lm_eval_available

pytestmark = pytest.mark.skipif(
    not lm_eval_available(), reason="lm-eval is not installed (optional extra: pip install -e '.[lmeval]')")

DOCS = [
    {"question": "The sun rises in the", "choices": ["east", "west", "sea", "morning"]},
    {"question": "Water is", "choices": ["dry", "wet", "cold", "blue"]},
    {"question": "One plus one is", "choices": ["two", "three", "four", "one"]},
    {"question": "The capital of France is", "choices": ["Berlin", "Paris", "Rome", "Madrid"]},
    {"question": "Cats like to drink", "choices": ["oil", "milk", "sand", "ink"]},
    {"question": "In winter it is often", "choices": ["hot", "cold", "loud", "late"]},
    {"question": "A week has seven", "choices": ["days", "hours", "years", "cups"]},
    {"question": "People read a", "choices": ["book", "spoon", "cloud", "river"]},
]
"""Choices without a leading space: lm_eval joins question and choice with its target delimiter, " "."""


def write_task(root: Path, answers: list[int] | None = None) -> Path:
    """A task YAML reading a local jsonl through the `json` dataset builder: no network."""
    root.mkdir()
    answers = answers or [0] * len(DOCS)
    (root / "docs.jsonl").write_text(
        "".join(json.dumps({**doc, "answer": answer}) + "\n" for doc, answer in zip(DOCS, answers, strict=True)))
    (root / "tiny_mc.yaml").write_text(
        "task: isollm_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return root


@pytest.fixture(scope="module")
def sharp_model(bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model saved with the BPE: its wide initialisation makes per-token log-probabilities
    differ by nats, so scoring the wrong tokens moves the argmax (a few training steps leave a model
    nearly uniform, whose choice ranking only counts tokens and hides such a mistake)."""
    from tokenizers import Tokenizer

    from llm.hf import save_for_hub
    from llm.model import IsoLLMConfig, IsoLLMForCausalLM

    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5))
    return save_for_hub(model, tmp_path_factory.mktemp("sharp") / "model", tokenizer=Tokenizer.from_file(str(bpe)))


def choice_scores(model_dir: Path) -> list[list[float]]:
    """lm_eval's log-likelihood of every choice, computed here from the model itself: the summed
    log-probability of the choice's tokens (" " + choice) after the question's."""
    from llm.eval.evaluate import load_model, resolve_checkpoint
    from llm.eval.lm_eval_adapter import hf_tokenizer

    resolved = resolve_checkpoint(str(model_dir))
    model, tokenizer = load_model(resolved), hf_tokenizer(resolved.model_path)
    scores = []
    for doc in DOCS:
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        row = []
        for choice in doc["choices"]:
            continuation = tokenizer.encode(" " + choice, add_special_tokens=False)
            # lm_eval encodes the whole text and cuts after the context: the same split
            assert tokenizer.encode(f"{doc['question']} {choice}", add_special_tokens=False) == [
                *context, *continuation]
            tokens = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = model(tokens[:, :-1]).logits.log_softmax(-1)[0, len(context) - 1:]
            row.append(logprobs.gather(-1, tokens[0, len(context):, None]).sum().item())
        scores.append(row)
    return scores


def test_lm_eval_accuracy_is_the_models_own(sharp_model: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each document's answer is the choice the model scores highest, so ``acc`` is 1 exactly when lm_eval
    picks the model's own argmax for every document; one mis-scored document makes it 7/8."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scores = choice_scores(sharp_model)
    answers = [max(range(len(row)), key=row.__getitem__) for row in scores]
    # clear winners (lm_eval's batched forward differs from this one by rounding only) and not all the same
    assert all(sorted(row)[-1] - sorted(row)[-2] > 1e-3 for row in scores) and len(set(answers)) > 1
    tasks = write_task(tmp_path / "tasks", answers)
    assert main(["lm-eval", str(sharp_model), "--tasks", "isollm_tiny_mc", "--include-path", str(tasks),
                 "--no-default-tasks", "--batch-size", "3", "--device", "cpu", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["isollm_tiny_mc"]
    assert results["acc,none"] == 1.0
    assert results["acc_stderr,none"] == 0.0


def test_unknown_task_is_a_clear_error(trained_run: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    tasks = write_task(tmp_path / "tasks")
    assert main(["lm-eval", str(trained_run), "--tasks", "no_such_task", "--include-path", str(tasks),
                 "--no-default-tasks"]) == 2
    assert "unknown task(s) no_such_task" in capsys.readouterr().err


GEN_PROMPTS = ["The sun", "Water is often very", "One", "The capital of France is a city", "Cats like",
               "In winter it is often cold and", "A week", "People read a good book in the"]
"""Prompts of different lengths: every batch of 4 is left-padded."""
GEN_TOKENS = 6


def write_generation_task(root: Path, targets: list[str]) -> Path:
    root.mkdir()
    (root / "docs.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in zip(GEN_PROMPTS, targets, strict=True)))
    (root / "tiny_gen.yaml").write_text(
        "task: isollm_tiny_gen\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{target}}"\n'
        f"generation_kwargs:\n  until: ['\\n']\n  do_sample: false\n  max_gen_toks: {GEN_TOKENS}\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return root


def greedy_alone(model_dir: Path) -> list[str]:
    """Each prompt's greedy continuation generated alone, cut as lm_eval cuts it (at its stop sequences)."""
    from llm.eval.evaluate import load_model, resolve_checkpoint
    from llm.eval.lm_eval_adapter import hf_tokenizer

    resolved = resolve_checkpoint(str(model_dir))
    model, tokenizer = load_model(resolved), hf_tokenizer(resolved.model_path)
    texts = []
    for prompt in GEN_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN_TOKENS, do_sample=False)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        texts.append(text.split("\n")[0])
    return texts


@pytest.mark.parametrize("scoring", ["softmax", "iso_tanh"])
def test_generate_until_with_batch_size_4_generates_what_each_prompt_does_alone(
        bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        scoring: str) -> None:
    """The targets are each prompt's own greedy continuation: exact_match is 1 only if every left-padded
    row of lm_eval's batches generates exactly what its prompt generates alone."""
    from tokenizers import Tokenizer

    from llm.hf import save_for_hub
    from llm.model import IsoLLMConfig, IsoLLMForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5, attn_scoring=scoring))
    model_dir = save_for_hub(model, tmp_path / "model", tokenizer=Tokenizer.from_file(str(bpe)))
    targets = greedy_alone(model_dir)
    assert len(set(targets)) > 1 and all(targets)  # distinct, non-empty: a wrong row cannot match by luck
    tasks = write_generation_task(tmp_path / "tasks", targets)
    batches: list[torch.Tensor] = []  # each generate() call's attention mask: rows and their padding
    generate = IsoLLMForCausalLM.generate

    def recording_generate(self, *args, **kwargs):
        batches.append(kwargs["attention_mask"].clone())
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(IsoLLMForCausalLM, "generate", recording_generate)
    assert main(["lm-eval", str(model_dir), "--tasks", "isollm_tiny_gen", "--include-path", str(tasks),
                 "--no-default-tasks", "--batch-size", "4", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["isollm_tiny_gen"]["exact_match,none"] == 1.0
    # the prompts really went in batches of 4, left-padded: a padded position before a real one in some row
    assert [mask.shape[0] for mask in batches] == [4, 4]
    assert all((mask[:, :-1] < mask[:, 1:]).any() for mask in batches)


def test_a_task_whose_dataset_cannot_be_fetched_fails_in_one_line_naming_it(
        sharp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline: the hub dataset of the second task cannot be fetched (the flags are read at import, hence
    patched where they live: without them each request is retried for ~30 s first, then fails the same)."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    tasks = write_task(tmp_path / "tasks")
    (tasks / "hub.yaml").write_text(
        (tasks / "tiny_mc.yaml").read_text().replace("isollm_tiny_mc", "isollm_hub_mc")
        .replace("dataset_path: json", "dataset_path: isollm-test/not-downloaded"))
    assert main(["lm-eval", str(sharp_model), "--tasks", "isollm_tiny_mc,isollm_hub_mc", "--include-path",
                 str(tasks), "--no-default-tasks"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --tasks isollm_hub_mc: cannot load its dataset (")
    assert "--include-path DIR" in errors[0]
