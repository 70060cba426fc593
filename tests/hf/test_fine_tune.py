"""Downstream fine-tuning as small-model papers evaluate: a trained checkpoint loads into a classification head
(only the head initialised), the HF ``Trainer`` fine-tunes it on CPU, and the result loads back through
``trust_remote_code`` where ``llm`` is not installed."""

from __future__ import annotations

import json

import torch
from datasets import Dataset
from fresh_process import run_without_llm
from transformers import AutoConfig, AutoModelForSequenceClassification, Trainer, TrainingArguments

import llm  # noqa: F401  (registers the Auto classes)
from llm.hf import save_for_hub
from llm.model import IsoLLMConfig, IsoLLMForCausalLM, IsoLLMForSequenceClassification

VOCAB, SEQ = 64, 8
FRESH_PROCESS = """
    import json
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

    model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor(json.loads(sys.argv[2]))).logits
    # the pretrained causal LM's directory lists the base model and the heads as well (its auto_map)
    loaded = [type(auto.from_pretrained(sys.argv[3], trust_remote_code=True)).__name__
              for auto in (AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification)]
    print(json.dumps({"class": type(model).__name__, "module": type(model).__module__, "logits": logits.tolist(),
                      "from_pretrained": loaded}))
"""


def trained_checkpoint(directory) -> None:
    """A tiny causal LM after a few next-token steps on random text, saved as a hub directory."""
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(5):
        model(torch.randint(1, VOCAB, (8, SEQ)), labels=torch.randint(1, VOCAB, (8, SEQ))).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_for_hub(model.eval(), directory)


def parity_task(count: int, seed: int) -> Dataset:
    """Label: whether the last token is in the upper half of the vocabulary (0 is padding and never drawn)."""
    ids = torch.randint(1, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids[:, -1] >= VOCAB // 2).long().tolist()})


def test_a_sequence_classification_head_fine_tunes_with_the_trainer_and_loads_without_llm(tmp_path):
    trained_checkpoint(tmp_path / "pretrained")
    config = AutoConfig.from_pretrained(tmp_path / "pretrained", num_labels=2)
    config.pad_token_id = 0  # a tokenizer's padding id (save_for_hub sets it from the tokenizer it is given)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "pretrained", config=config)
    assert type(model) is IsoLLMForSequenceClassification
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=16, learning_rate=3e-3,
                             max_steps=24, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                             seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=parity_task(128, 0), eval_dataset=parity_task(64, 1))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.8 * before, (before, after)
    trainer.save_model(tmp_path / "fine-tuned")

    probe = torch.tensor(parity_task(4, 2)["input_ids"])
    done = run_without_llm(FRESH_PROCESS, str(tmp_path / "fine-tuned"), json.dumps(probe.tolist()),
                           str(tmp_path / "pretrained"), cwd=tmp_path)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["class"] == "IsoLLMForSequenceClassification" and got["module"].startswith("transformers_modules.")
    assert got["from_pretrained"] == ["IsoLLMModel", "IsoLLMForSequenceClassification", "IsoLLMForTokenClassification"]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(got["logits"]), model.eval()(probe.to(model.device)).logits.cpu(),
                                   rtol=0, atol=1e-6)
