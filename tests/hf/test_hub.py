"""Hub directories load with trust_remote_code in a fresh process that cannot import ``llm``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fresh_process import run_without_llm, stderr_besides_progress
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import AutoModelForCausalLM, AutoTokenizer

import llm  # noqa: F401  (registers the Auto classes)
from llm.data.errors import DataError
from llm.data.tokenizer import EOS_TOKEN
from llm.hf import export_qwen3, save_for_hub
from llm.model import IsoLLMConfig, IsoLLMForCausalLM
from llm.model.modeling_isollm import AUTO_CLASSES

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, iso_tanh_chunk_size=4)
VARIANTS = {
    "swiglu_softmax": dict(),
    "isogmlp_causal_mean_iso_tanh": dict(ffn="isogmlp", isogmlp_gate="causal_mean", attn_scoring="iso_tanh"),
    "iso_ln_focus_untied": dict(ffn="iso_ln", ffn_linear="focus", tie_word_embeddings=False),
}
PROMPT = torch.arange(2 * 6).view(2, 6) * 7 % 256
NEW_TOKENS = 8

FRESH_PROCESS = """
    import torch
    from transformers import AutoModelForCausalLM

    results = {}
    for directory in sys.argv[2:]:
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        inputs = torch.load(sys.argv[1])
        with torch.no_grad():
            logits = model(inputs["prompt"]).logits
        results[directory] = {
            "module": type(model).__module__,
            "logits": logits,
            "greedy": model.generate(inputs["prompt"], max_new_tokens=inputs["new_tokens"], do_sample=False),
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        }
    torch.save(results, sys.argv[1] + ".out")
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[IsoLLMForCausalLM, Path]]:
    root = tmp_path_factory.mktemp("hub")
    out = {}
    for i, (name, variant) in enumerate(VARIANTS.items()):
        torch.manual_seed(i)
        model = IsoLLMForCausalLM(IsoLLMConfig(**TINY, **variant)).eval()
        out[name] = (model, save_for_hub(model, root / name))
    return out


def test_hub_directory_holds_config_auto_map_and_code(saved):
    _, directory = saved["swiglu_softmax"]
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "isollm"
    assert config["auto_map"] == {"AutoConfig": "configuration_isollm.IsoLLMConfig",
                                  **{auto: f"modeling_isollm.{name}" for auto, name in AUTO_CLASSES.items()}}
    assert set(AUTO_CLASSES) == {"AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                                 "AutoModelForTokenClassification"}
    card = (directory / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: ") and "No training run was recorded" in card
    assert f'from_pretrained("{directory}", trust_remote_code=True)' in card
    copied = {path.name: path.read_text() for path in directory.glob("*.py")}
    assert {"modeling_isollm.py", "configuration_isollm.py", "attention.py", "fla_kernel.py"} <= set(copied)
    for name, text in copied.items():
        assert "import llm" not in text and "from llm" not in text, name


def test_fresh_process_without_llm_gets_identical_logits_and_generations(saved, tmp_path):
    inputs = tmp_path / "inputs.pt"
    torch.save({"prompt": PROMPT, "new_tokens": NEW_TOKENS}, inputs)
    done = run_without_llm(FRESH_PROCESS, str(inputs), *(str(directory) for _, directory in saved.values()),
                           cwd=tmp_path)
    assert stderr_besides_progress(done) == []  # no warning: neither a deprecated cache name nor a config mismatch
    results = torch.load(str(inputs) + ".out")
    for model, directory in saved.values():
        got = results[str(directory)]
        assert got["module"].startswith("transformers_modules.")  # the copied code, not llm
        with torch.no_grad():
            assert torch.equal(got["logits"], model(PROMPT).logits)
        greedy = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(got["greedy"], greedy)
        assert got["tied"] == model.config.tie_word_embeddings


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_from_pretrained_in_process_keeps_weights_and_tying(saved, name):
    model, directory = saved[name]
    loaded = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == model.config.tie_word_embeddings
    expected = model.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert loaded.config.to_model_config() == model.config.to_model_config()


def test_save_for_hub_writes_a_tokenizer_auto_tokenizer_loads(tmp_path):
    tokenizer = Tokenizer(WordLevel({"<unk>": 0, EOS_TOKEN: 1, "the": 2, "cat": 3}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    model = IsoLLMForCausalLM(IsoLLMConfig(**TINY))
    save_for_hub(model, tmp_path, tokenizer=tokenizer)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("the cat dog")["input_ids"] == [2, 3, 0]
    assert loaded.eos_token_id == 1
    without_eos = Tokenizer(WordLevel({"<unk>": 0, "the": 1}, unk_token="<unk>"))
    with pytest.raises(DataError, match=f"tokenizer has no {EOS_TOKEN} token"):  # not one added past the vocab
        save_for_hub(model, tmp_path / "no-eos", tokenizer=without_eos)


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer covering the tiny vocabulary: ``w2`` ... ``w255``, eos id 1."""
    vocab = {"<unk>": 0, EOS_TOKEN: 1, **{f"w{i}": i for i in range(2, TINY["vocab_size"])}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    return tokenizer


TOKENIZE = """
    import json
    import transformers

    tokenizer = getattr(transformers, sys.argv[2]).from_pretrained(sys.argv[1])
    # on a line of its own: the question (``input``'s prompt) ends with no newline
    got = [type(tokenizer).__name__, tokenizer("w5 w9 w14 w300")["input_ids"], tokenizer.eos_token_id]
    print()
    print(json.dumps(got))
"""


@pytest.mark.slow
def test_auto_tokenizer_without_trust_remote_code_asks_then_falls_back_and_the_fast_class_does_not_ask(tmp_path):
    """Pins transformers 5.23's behaviour (docs/hub.md, "Fine-tuning with TRL"), so that the day it changes a test
    says so. ``AutoTokenizer.from_pretrained(directory)`` reads config.json first (``AutoConfig``), whose auto_map
    names remote code for a model type it does not know: it asks the remote-code question, and with stdin closed
    (``input`` meets EOF: a ValueError) falls back to a bare ``PreTrainedConfig``, warns of "a model of type ``",
    and loads the stock fast tokenizer from tokenizer_config.json, the project tokenizer's ids. No checkpoint
    layout avoids it: the question comes from config.json's ``AutoConfig`` entry, which
    ``AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`` needs (without it: "does not
    recognize this architecture"), and nothing of the tokenizer's is read before config.json.
    ``PreTrainedTokenizerFast.from_pretrained(directory)`` reads no model config: the same ids, no question."""
    directory = save_for_hub(IsoLLMForCausalLM(IsoLLMConfig(**TINY)), tmp_path / "model", tokenizer=word_tokenizer())
    expected = word_tokenizer().encode("w5 w9 w14 w300").ids
    assert expected == [5, 9, 14, 0]
    auto = run_without_llm(TOKENIZE, str(directory), "AutoTokenizer", cwd=tmp_path, asks=True)
    assert "You are using a model of type `isollm` to instantiate a model of type ``" in auto.stderr
    fast = run_without_llm(TOKENIZE, str(directory), "PreTrainedTokenizerFast", cwd=tmp_path)
    assert stderr_besides_progress(fast) == []
    for done in (auto, fast):
        assert json.loads(done.stdout.strip().splitlines()[-1]) == ["TokenizersBackend", expected, 1]


COMPLETE_DIRECTORY = """
    import json
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    prompts = ["w5 w9 w14 w3 w77", "w7", "w2 w8"]
    report = {}
    for directory, kind in (arg.split("=") for arg in sys.argv[1:]):
        remote = {"trust_remote_code": True} if kind == "isollm" else {}
        # transformers 5 reads the model config before the tokenizer's: an isollm directory needs the flag, or
        # it asks whether to run the code and then warns that a config of type `` reads an `isollm` one
        tokenizer = AutoTokenizer.from_pretrained(directory, **remote)
        model = AutoModelForCausalLM.from_pretrained(directory, **remote)
        generator = pipeline("text-generation", model=directory, **remote)
        settings = dict(max_new_tokens=4, do_sample=False, return_full_text=False)
        batched = generator(prompts, batch_size=len(prompts), **settings)
        report[directory] = {
            "tokenizer": type(tokenizer).__name__, "ids": tokenizer("w5 w9")["input_ids"],
            "special": [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.padding_side],
            "config": [model.config.eos_token_id, model.config.pad_token_id],
            "generation_config": [model.generation_config.eos_token_id, model.generation_config.pad_token_id],
            "model": type(model).__name__,
            "batched": [row[0]["generated_text"] for row in batched],
            "alone": [generator(prompt, **settings)[0]["generated_text"] for prompt in prompts],
        }
    print(json.dumps(report))
"""


@pytest.mark.slow
def test_checkpoint_and_qwen3_directories_are_complete_for_a_user_without_llm(tmp_path):
    """AutoTokenizer (no prompt, stock class), AutoModelForCausalLM and a batched text-generation
    pipeline (left padding) load each directory; eos / pad ids are set; each padded row generates what
    its prompt generates alone."""
    directories = {}
    for name, variant in {"softmax": {}, "iso_tanh": VARIANTS["isogmlp_causal_mean_iso_tanh"]}.items():
        torch.manual_seed(0)
        model = IsoLLMForCausalLM(IsoLLMConfig(**TINY, **variant))
        directories[save_for_hub(model, tmp_path / name, tokenizer=word_tokenizer())] = "isollm"
        if name == "softmax":
            directories[export_qwen3(model, tmp_path / "qwen3", tokenizer=word_tokenizer())] = "qwen3"
    for directory in directories:
        for name in ("config.json", "generation_config.json"):
            saved_config = json.loads((directory / name).read_text())
            assert (saved_config["eos_token_id"], saved_config["pad_token_id"]) == (1, 1), (directory, name)
        assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == \
            "PreTrainedTokenizerFast"
    done = run_without_llm(COMPLETE_DIRECTORY, *(f"{d}={kind}" for d, kind in directories.items()), cwd=tmp_path)
    assert stderr_besides_progress(done) == []
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for directory, kind in directories.items():
        got = report[str(directory)]
        assert got["model"] == ("Qwen3ForCausalLM" if kind == "qwen3" else "IsoLLMForCausalLM")
        assert got["ids"] == [5, 9] and got["special"] == [1, 1, "left"]
        assert got["config"] == got["generation_config"] == [1, 1]
        assert got["batched"] == got["alone"] and all(got["alone"]), got


QUIET_SAVE = """
import sys
from llm.hf import save_model_dir
from llm.model import IsoLLMConfig, IsoLLMForCausalLM

save_model_dir(IsoLLMForCausalLM(IsoLLMConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)),
               sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed_launch", [False, True])
def test_saving_a_model_directory_prints_nothing_unless_deepspeed_runs(tmp_path, deepspeed_launch):
    """No "Writing model shards" bar (it would cut through the training progress bar) and, outside a
    DeepSpeed launch, no DeepSpeed "Setting accelerator to CPU" from the import transformers triggers."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_DEEPSPEED": str(deepspeed_launch).lower()}
    done = subprocess.run([sys.executable, "-c", QUIET_SAVE, str(tmp_path / "model")], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    assert (tmp_path / "model" / "model.safetensors").is_file()
    if not deepspeed_launch:
        assert done.stdout + done.stderr == ""
    elif importlib.util.find_spec("deepspeed") is not None:
        assert "Setting accelerator to CPU" in done.stdout  # a DeepSpeed run keeps DeepSpeed's own output


def test_a_config_written_before_ffn_init_existed_loads_with_the_papers_raw_scales(tmp_path: Path) -> None:
    """Such a model was trained with the raw affine_like / iso-activation scales; loading it as the new
    scale-matched default would silently change its outputs."""
    model = IsoLLMForCausalLM(IsoLLMConfig(**TINY, ffn="iso_mlp", ffn_linear="affine_like", ffn_init="paper"))
    model.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    written = json.loads(config_path.read_text())
    del written["ffn_init"]
    config_path.write_text(json.dumps(written))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.ffn_init == "paper"
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, model.eval()(PROMPT).logits, rtol=0, atol=0)
    assert IsoLLMConfig(**TINY).ffn_init == "matched"  # a new model keeps the default


@pytest.mark.parametrize("variant", [{}, {"ffn": "iso_mlp"}, {"ffn": "iso_mlp", "iso_activation": "relu"}],
                         ids=["swiglu", "iso_mlp_tanh", "iso_mlp_relu"])
def test_a_config_written_before_ffn_init_existed_loads_with_the_options_of_its_time(tmp_path: Path,
                                                                                     variant: dict) -> None:
    """Such a file holds every option at the defaults of its time (iso_r0 1.0, iso_r_cap 8.0), read by its
    variant or not: the unread ones are ignored (not refused), the read ones kept."""
    old = {"ffn_init": "paper"} if variant else {}  # iso_mlp reads ffn_init, relu iso_r0 too
    model = IsoLLMForCausalLM(IsoLLMConfig(**TINY, **variant, **old,
                                           **({"iso_r0": 1.0} if "iso_activation" in variant else {})))
    model.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    written = json.loads(config_path.read_text())
    del written["ffn_init"], written["mixing_lr_mult"]
    written.update(iso_r0=1.0, iso_r_cap=8.0)
    config_path.write_text(json.dumps(written))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.iso_r0 == (1.0 if "iso_activation" in variant else 0.5)
    assert loaded.config.iso_r_cap == 1.0
    assert loaded.config.ffn_init == ("paper" if variant else "matched")
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, model.eval()(PROMPT).logits, rtol=0, atol=0)


def test_the_model_package_needs_torch_and_transformers_only(tmp_path: Path) -> None:
    """With accelerate and DeepSpeed not installed (a hub user), ``import llm`` registers the Auto classes and a
    model builds, runs and generates. Where both are installed, transformers' own generation code imports
    accelerate (``transformers.generation.utils``, ``transformers.integrations.deepspeed``): nothing of ours."""
    script = """
        import sys
        sys.modules["accelerate"] = sys.modules["deepspeed"] = None  # not installed, for find_spec and import
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        import llm

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("isollm", **json.loads(sys.argv[1])))
        out = model.generate(torch.arange(6).view(1, 6), max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 9) and not any(name.startswith(("accelerate.", "deepspeed.")) for name in sys.modules)
    """
    done = subprocess.run([sys.executable, "-c", "import json\n" + textwrap.dedent(script), json.dumps(TINY)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
