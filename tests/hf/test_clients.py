"""The tools people fine-tune with, on a tiny trained checkpoint loaded as a stranger loads it (a fresh process
without ``llm``, ``trust_remote_code=True``): transformers' ``Trainer`` under gradient accumulation beside the
stock Qwen3 export, PEFT's ``all-linear`` LoRA on the causal LM and a classification head for every FFN, and a
short TRL ``SFTTrainer`` fine-tune with and without LoRA (docs/hub.md, "Fine-tuning")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fresh_process import run_without_llm
from test_hub import TINY, word_tokenizer

from llm.hf import export_qwen3, save_for_hub
from llm.model import IsoLLMConfig, IsoLLMForCausalLM

pytest.importorskip("peft")
pytest.importorskip("trl")


def trained_checkpoint(directory: Path, **variant: object) -> IsoLLMForCausalLM:
    """A tiny causal LM after a few next-token steps on random text, saved as a hub directory with a tokenizer."""
    torch.manual_seed(0)
    model = IsoLLMForCausalLM(IsoLLMConfig(**TINY, **variant))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(4):
        ids = torch.randint(2, TINY["vocab_size"], (8, 9))
        model(ids[:, :-1], shift_labels=ids[:, 1:], fused_loss=True).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_for_hub(model.eval(), directory, tokenizer=word_tokenizer())
    return model


TRAINER = """
    import json
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Trainer, TrainingArguments

    # 24 right-padded rows of 3 to 10 tokens (padding id 1, its labels -100): micro-batches of unequal targets
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (24, 10), generator=generator)
    mask = (torch.arange(10) < torch.randint(3, 11, (24, 1), generator=generator)).long()
    ids = ids * mask + (1 - mask)
    labels = ids.masked_fill(mask == 0, -100)
    causal = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()}
    classes = {**causal, "labels": (ids[:, 0] % 2).tolist()}

    def fine_tune(load, rows, accumulation):
        torch.manual_seed(0)  # a classification head's score: the same draw at every accumulation
        model = load()
        before = [p.detach().clone() for p in model.parameters()]
        args = TrainingArguments(output_dir="run", per_device_train_batch_size=8 // accumulation,
                                 gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5,
                                 lr_scheduler_type="constant", max_grad_norm=1e9, max_steps=3, logging_steps=1,
                                 use_cpu=True, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict(rows))
        trainer.train()
        logs = [row for row in trainer.state.log_history if "loss" in row]
        moved = sum((p.detach() - b).pow(2).sum() for p, b in zip(model.parameters(), before)).sqrt().item()
        return {"loss": [row["loss"] for row in logs], "grad_norm": [row["grad_norm"] for row in logs], "moved": moved}

    report = {}
    isollm, qwen3 = sys.argv[1], sys.argv[2]
    for name, load, rows in (
        ("isollm", lambda: AutoModelForCausalLM.from_pretrained(isollm, trust_remote_code=True), causal),
        ("qwen3", lambda: AutoModelForCausalLM.from_pretrained(qwen3), causal),
        ("isollm-classification", lambda: AutoModelForSequenceClassification.from_pretrained(
            isollm, trust_remote_code=True, num_labels=2), classes),
    ):
        for accumulation in (1, 4):
            report[f"{name} GA={accumulation}"] = fine_tune(load, rows, accumulation)
    print(json.dumps(report))
"""


@pytest.mark.slow
def test_trainer_logs_and_moves_the_same_at_every_gradient_accumulation_as_transformers_qwen3(tmp_path):
    """Right-padded rows, batch 8, SGD, no clipping: GA=4 (micro-batches of 2) logs the losses and gradient norms of
    GA=1 and moves the weights as far, for the causal LM (as the stock Qwen3 export of the same weights does, to the
    same figures) and for the sequence-classification head."""
    model = trained_checkpoint(tmp_path / "isollm")
    export_qwen3(model, tmp_path / "qwen3", tokenizer=word_tokenizer())
    done = run_without_llm(TRAINER, str(tmp_path / "isollm"), str(tmp_path / "qwen3"), cwd=tmp_path)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("isollm", "qwen3", "isollm-classification"):
        one, four = report[f"{name} GA=1"], report[f"{name} GA=4"]
        assert len(one["loss"]) == 3, report
        for key in ("loss", "grad_norm", "moved"):
            torch.testing.assert_close(torch.tensor(four[key]), torch.tensor(one[key]), rtol=1e-4, atol=1e-4,
                                       msg=f"{name} {key}: {report}")
    for key in ("loss", "grad_norm", "moved"):  # the stock Qwen3 of the same weights gives the same figures
        torch.testing.assert_close(torch.tensor(report["isollm GA=4"][key]), torch.tensor(report["qwen3 GA=4"][key]),
                                   rtol=1e-4, atol=1e-4, msg=f"{key}: {report}")


PEFT = """
    import json
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    probe = torch.randint(2, 256, (2, 7), generator=torch.Generator().manual_seed(9))
    report = {}
    for directory in sys.argv[1:]:
        for head, auto, task in (("causal", AutoModelForCausalLM, "CAUSAL_LM"),
                                 ("classification", AutoModelForSequenceClassification, "SEQ_CLS")):
            def load():
                torch.manual_seed(0)
                extra = {"num_labels": 2} if head == "classification" else {}
                return auto.from_pretrained(directory, trust_remote_code=True, **extra).eval()

            with torch.no_grad():
                base = load()(probe).logits
            model = get_peft_model(load(), LoraConfig(task_type=task, target_modules="all-linear", r=4))
            adapted = sorted({name.split(".lora_A")[0].split("model.layers.")[-1]
                              for name, _ in model.named_parameters() if ".lora_A." in name})
            initial = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" in name}
            optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
            model.train()
            for step in range(3):
                ids = torch.randint(2, 256, (4, 8), generator=torch.Generator().manual_seed(step))
                model(input_ids=ids, labels=ids if head == "causal" else ids[:, -1] % 2).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            model.eval()
            unchanged = [name for name, p in model.named_parameters() if name in initial and p.equal(initial[name])]
            adapter = f"{directory}-{head}-adapter"
            model.save_pretrained(adapter)
            with torch.no_grad():
                trained = model(probe).logits
                reloaded = PeftModel.from_pretrained(load(), adapter).eval()
                again = reloaded(probe).logits
                merged = reloaded.merge_and_unload()(probe).logits
            report[f"{directory} {head}"] = {
                "adapted": adapted, "unchanged": unchanged, "trained": (trained - base).abs().max().item(),
                "reloaded": (again - trained).abs().max().item(), "merged": (merged - trained).abs().max().item()}
    print(json.dumps(report))
"""
FFNS = ("swiglu", "isogmlp", "iso_ln", "iso_mlp")


FUSED_IN = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "in_proj",
            "up_proj": "in_proj"}
"""A stock Qwen3 module -> the isollm projection that fuses it."""


def fused_names(adapted: list[str]) -> set[str]:
    """Adapted module names with Qwen3's separate projections named as the isollm projection fusing them."""
    return {".".join(FUSED_IN.get(part, part) for part in name.split(".")) for name in adapted}


@pytest.mark.slow
def test_peft_all_linear_adapts_every_projection_and_trains_saves_reloads_and_merges_for_every_ffn(tmp_path):
    """``target_modules="all-linear"`` adapts exactly what it adapts in the stock Qwen3 export of the same shape
    (attention's and both FFN sides' projections, Qwen3's separate ones named by the isollm projection fusing them;
    isogmlp's alpha-gate readout not) in every layer, on the causal LM and a classification head; every adapter
    weight trains, and reloaded or merged gives the trained outputs."""
    directories = [tmp_path / ffn for ffn in FFNS]
    for ffn, directory in zip(FFNS, directories, strict=True):
        model = trained_checkpoint(directory, ffn=ffn)
        if ffn == "swiglu":
            export_qwen3(model, tmp_path / "qwen3", tokenizer=word_tokenizer())
    done = run_without_llm(PEFT, *map(str, directories), str(tmp_path / "qwen3"), cwd=tmp_path)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for head in ("causal", "classification"):
        qwen3 = report[f"{tmp_path / 'qwen3'} {head}"]
        assert {"0.self_attn.qkv_proj", "0.mlp.in_proj", "0.mlp.down_proj"} <= fused_names(qwen3["adapted"]), qwen3
        for directory in [*directories, tmp_path / "qwen3"]:
            got = report[f"{directory} {head}"]
            assert fused_names(got["adapted"]) == fused_names(qwen3["adapted"]), (directory, head, got["adapted"])
            assert not got["unchanged"], (directory, head, got["unchanged"])
            assert got["trained"] > 1e-3, (directory, head, got)
            assert got["reloaded"] < 1e-5 and got["merged"] < 1e-5, (directory, head, got)


@pytest.mark.parametrize(("variant", "target"), [({"ffn_linear": "affine_like"}, "in_proj"),
                                                 ({"ffn_linear": "focus"}, "in_proj"),
                                                 ({"ffn": "isogmlp"}, "alpha_gate.proj")])
def test_lora_on_a_module_that_is_not_a_linear_projection_is_refused_naming_it_and_why(variant, target):
    """An input projection that is not linear in x, or isogmlp's 1-output gate readout (read in one vecdot)."""
    from peft import LoraConfig, get_peft_model

    model = IsoLLMForCausalLM(IsoLLMConfig(**TINY, **variant))
    with pytest.raises(ValueError, match=r"Target module (AffineLike|Focus|GateReadout)\(.*no LoRA: .*\) is not "
                                         r"supported") as err:
        get_peft_model(model, LoraConfig(target_modules=[target]))
    assert "\n" not in str(err.value)
    adapted = get_peft_model(model, LoraConfig(target_modules="all-linear"))  # the linear projections only
    assert {"qkv_proj", "o_proj", "down_proj"} <= {n.split(".")[-4] for n, _ in adapted.named_parameters()
                                                   if n.endswith("lora_A.default.weight")}


SFT = """
    import json
    import torch
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    directory = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    texts = [" ".join(f"w{2 + (start + k) % 12}" for k in range(10)) for start in range(32)]  # a learnable cycle
    probe = tokenizer(texts[:2], return_tensors="pt")["input_ids"]
    report = {}
    for name, lora in (("full", None), ("lora", LoraConfig(target_modules="all-linear", r=8))):
        torch.manual_seed(0)
        args = SFTConfig(output_dir=f"sft-{name}", max_steps=16, per_device_train_batch_size=8,
                         learning_rate=1e-2 if lora is None else 3e-2, logging_steps=1, use_cpu=True, bf16=False,
                         report_to=[], save_strategy="no", seed=0, disable_tqdm=True, max_length=16)
        trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True), args=args,
                             train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer,
                             peft_config=lora)
        trainer.train()
        trainer.save_model(args.output_dir)
        logs = [row for row in trainer.state.log_history if "loss" in row]
        with torch.no_grad():
            trained = trainer.model.eval()(probe).logits
            loaded = AutoModelForCausalLM.from_pretrained(args.output_dir if lora is None else directory,
                                                          trust_remote_code=True)
            if lora is not None:
                loaded = PeftModel.from_pretrained(loaded, args.output_dir)
            again = loaded.eval()(probe).logits
        adapted = {n.split(".lora_A")[0].split(".")[-1] for n, _ in trainer.model.named_parameters() if ".lora_A." in n}
        report[name] = {"loss": [row["loss"] for row in logs], "accuracy": [row["mean_token_accuracy"] for row in logs],
                        "reloaded": (again - trained).abs().max().item(), "adapted": sorted(adapted)}
    print(json.dumps(report))
"""


@pytest.mark.slow
def test_trl_sft_fine_tunes_with_token_accuracy_with_and_without_lora_and_the_result_loads_back(tmp_path):
    """TRL's ``SFTTrainer``: the loss falls and its token accuracy rises, a LoRA config's ``all-linear`` adapts every
    projection, and the saved model (or adapter) loads back to the trained outputs."""
    trained_checkpoint(tmp_path / "isollm")
    done = run_without_llm(SFT, str(tmp_path / "isollm"), cwd=tmp_path)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("full", "lora"):
        got = report[name]
        assert got["loss"][-1] < 0.95 * got["loss"][0], (name, got)
        assert got["accuracy"][-1] > got["accuracy"][0], (name, got)
        assert got["reloaded"] < 1e-5, (name, got)
    assert report["lora"]["adapted"] == ["down_proj", "in_proj", "o_proj", "qkv_proj"], report["lora"]
