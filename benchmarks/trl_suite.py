"""TRL's own GRPO tests, run on stock `GRPOTrainer` and again with `LongStrawGRPOTrainer` substituted.

    PYTHONPATH=. .venv/bin/python benchmarks/trl_suite.py --trl-checkout PATH/TO/trl

`--trl-checkout` is a clone of the TRL repository (its `tests/` and `scripts/` are read, nothing of it is imported
into this project). No Hub access is needed: the `trl-internal-testing` fixtures the tests load are rebuilt offline
under `--work` by TRL's own generator scripts (`scripts/generate_zen_dataset.py`,
`scripts/generate_tiny_models/`), with their Hub calls replaced: the reference tokenizers are byte-level stand-ins
that keep what the tests rely on (Qwen's token ids for `<|im_end|>`, `<tool_call>` and every multi-byte token a test
hard-codes, each model's special tokens and TRL's copy of its chat template), and the generated model and dataset
are saved to a local folder of the same name instead of pushed. The tests then resolve
`trl-internal-testing/...` to those folders.

The LongStraw run copies the tests with one line changed: `from trl import GRPOConfig, GRPOTrainer` imports
`LongStrawGRPOConfig` and `LongStrawGRPOTrainer` under those names. Stock then runs every test (or, with `--stock
others`, only those LongStraw does not pass; `--stock-skip` leaves tests out of the stock run, e.g. the tool-calling
ones, whose full-sequence scoring of long char-level prompts takes stock more than ten minutes a test on 2 CPU
cores). The report (`--output`) counts the tests that pass on stock and which of those pass with LongStraw, and
lists every other test with its message.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
ORGANIZATION = "trl-internal-testing"
STOCK_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
LONGSTRAW_IMPORT = "from trl_longstraw import LongStrawGRPOConfig as GRPOConfig, LongStrawGRPOTrainer as GRPOTrainer"

# The generator scripts (under the checkout's scripts/generate_tiny_models/) whose models the GRPO tests load.
TINY_MODEL_SCRIPTS = (
    "for_causal_lm.qwen2_for_causal_lm_2_5",
    "for_causal_lm.qwen3_for_causal_lm",
    "for_causal_lm.qwen3_moe_for_causal_lm",
    "for_causal_lm.llama_for_causal_lm_3_2",
    "for_causal_lm.mistral_for_causal_lm_0_2",
    "for_causal_lm.gpt_oss_for_causal_lm",
    "for_causal_lm.glm4_moe_for_causal_lm",
    "for_causal_lm.cohere2_for_causal_lm",
    "for_causal_lm.gemma2_for_causal_lm",
    "for_causal_lm.remote_for_causal_lm",
    "for_causal_lm.nemotron_3_nano_for_causal_lm",
    "for_sequence_classification.qwen2_for_sequence_classification_2_5",
    "for_sequence_classification.qwen3_for_sequence_classification",
    "for_sequence_classification.llama_for_sequence_classification_3_2",
)

# Qwen's byte-level BPE: the multi-byte tokens whose ids the GRPO tests hard-code in fake completions ("Ġ" is a
# leading space, "Ċ" a newline, in GPT-2's byte-to-unicode alphabet). Ids 0-255 are the single bytes.
QWEN_TOKENS = {
    293: "Ġb", 314: "Ġ{", 330: 'Ġ"', 397: ">Ċ", 411: "out", 450: "de", 497: '",', 522: "</", 606: "name", 788: '":',
    894: "Ġany", 927: "sh", 944: "'t", 1318: "text", 1414: "Ġknow", 1513: "Ġdon", 2765: "Ġwon", 4913: '{"',
    5212: 'Ġ{"', 5392: "Ġtool", 6023: "hi", 6659: "call", 7692: "async", 9520: "step", 11248: "}}Ċ",
    13477: "crement", 14172: "tool", 16252: "Ġincrement", 16370: "arguments", 17453: "Done", 22785: "_tool",
    35744: "increment", 64648: "multiply", 93054: "_multiply", 95642: '"}}Ċ',
}  # fmt: skip
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
QWEN3_SPECIALS = QWEN_SPECIALS + ("<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_FIRST_SPECIAL = 151643

# A checkout newer or older than the installed trl may import availability checks this trl lacks: define those from
# the package they name, before the tests import them.
IMPORT_UTILS_SHIM = """import importlib.util as _util

import trl.import_utils as _import_utils

for _name in ("is_joblib_available",):
    if not hasattr(_import_utils, _name):
        _package = _name.removeprefix("is_").removesuffix("_available")
        setattr(_import_utils, _name, lambda _package=_package: _util.find_spec(_package) is not None)

"""

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode alphabet in vocabulary order: ids 0-255 of Qwen's (and GPT-2's) vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    shifted = [byte for byte in range(256) if byte not in printable]
    return [chr(byte) for byte in printable] + [chr(256 + index) for index in range(len(shifted))]


def byte_level_tokenizer(
    *,
    regular_size: int,
    specials: dict[int, str],
    tokens: dict[int, str],
    chat_template: str,
    eos: str,
    pad: str | None = None,
    bos: str | None = None,
):
    """A byte-level BPE tokenizer without merges: text encodes byte by byte; `tokens` (id -> byte-level string)
    decode as the reference tokenizer's do; `specials` sit at the reference's ids; the rest of the first
    `regular_size` ids are filler."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    taken = set(specials)
    byte_ids = [index for index in range(regular_size + len(specials)) if index not in taken][:256]
    vocab = {token: index for index, token in zip(byte_ids, byte_alphabet(), strict=True)}
    vocab.update({token: index for index, token in tokens.items()})
    vocab.update({token: index for index, token in specials.items()})
    used = set(vocab.values())
    vocab.update({f"<|filler_{index}|>": index for index in range(regular_size) if index not in used})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    for index in sorted(specials):
        backend.add_special_tokens([AddedToken(specials[index], special=True, normalized=False)])
        assert backend.token_to_id(specials[index]) == index, (specials[index], index)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, pad_token=pad, bos_token=bos, chat_template=chat_template
    )


def reference_tokenizer(model_id: str):
    """The stand-in for `AutoTokenizer.from_pretrained(model_id)` in the generator scripts."""
    template = files("trl") / "chat_templates"
    if model_id.startswith("Qwen/Qwen2.5"):
        specials = dict(enumerate(QWEN_SPECIALS, QWEN_FIRST_SPECIAL))
        return byte_level_tokenizer(
            regular_size=QWEN_FIRST_SPECIAL, specials=specials, tokens=QWEN_TOKENS,
            chat_template=(template / "qwen2_5.jinja").read_text(), eos="<|im_end|>", pad="<|endoftext|>",
        )  # fmt: skip
    if model_id.startswith("Qwen/Qwen3"):
        specials = dict(enumerate(QWEN3_SPECIALS, QWEN_FIRST_SPECIAL))
        return byte_level_tokenizer(
            regular_size=QWEN_FIRST_SPECIAL, specials=specials, tokens=QWEN_TOKENS,
            chat_template=(template / "qwen3.jinja").read_text(), eos="<|im_end|>", pad="<|endoftext|>",
        )  # fmt: skip
    if model_id.startswith("meta-llama/"):
        names = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        return byte_level_tokenizer(
            regular_size=512, specials=dict(enumerate(names, 512)), tokens={},
            chat_template=(template / "llama3_2.jinja").read_text(), eos="<|eot_id|>", bos="<|begin_of_text|>",
        )  # fmt: skip
    if model_id.startswith("mistralai/"):
        return byte_level_tokenizer(
            regular_size=512, specials={0: "<unk>", 1: "<s>", 2: "</s>"}, tokens={}, chat_template=MISTRAL_TEMPLATE,
            eos="</s>", bos="<s>",
        )  # fmt: skip
    if model_id.startswith("openai/gpt-oss"):
        names = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")
        return byte_level_tokenizer(
            regular_size=512, specials=dict(enumerate(names, 512)), tokens={},
            chat_template=(template / "gptoss.jinja").read_text(), eos="<|return|>", pad="<|endoftext|>",
        )  # fmt: skip
    if model_id.startswith("zai-org/GLM"):
        names = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
        specials = dict(zip((151329, 151331, 151333, 151335, 151336, 151337, 151338), names, strict=True))
        return byte_level_tokenizer(
            regular_size=151329, specials=specials, tokens={},
            chat_template=(template / "glm4moe.jinja").read_text(), eos="<|endoftext|>", pad="<|endoftext|>",
        )  # fmt: skip
    if model_id.startswith("CohereLabs/"):
        names = ("<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>")
        return byte_level_tokenizer(
            regular_size=512, specials=dict(enumerate(names)), tokens={},
            chat_template=(template / "cohere2.jinja").read_text(), eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>",
            bos="<BOS_TOKEN>",
        )  # fmt: skip
    if model_id.startswith("google/gemma"):
        names = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
        return byte_level_tokenizer(
            regular_size=512, specials=dict(enumerate(names)), tokens={},
            chat_template=(template / "gemma.jinja").read_text(), eos="<end_of_turn>", pad="<pad>", bos="<bos>",
        )  # fmt: skip
    if model_id.startswith("nvidia/"):
        names = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
        return byte_level_tokenizer(
            regular_size=512, specials=dict(enumerate(names)), tokens={},
            chat_template=(template / "nemotron_3_nano.jinja").read_text(), eos="<|im_end|>", pad="<unk>",
            bos="<s>",
        )  # fmt: skip
    raise KeyError(f"no offline stand-in for the tokenizer of {model_id}")


def reference_generation_config(model_id: str):
    """The stand-in for `GenerationConfig.from_pretrained(model_id)`: the reference's token ids and sampling."""
    from transformers import GenerationConfig

    if model_id.startswith("Qwen/Qwen2.5"):
        return GenerationConfig(
            bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
            temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
        )  # fmt: skip
    if model_id.startswith("Qwen/Qwen3"):
        return GenerationConfig(
            bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
            temperature=0.6, top_p=0.95, top_k=20,
        )  # fmt: skip
    tokenizer = reference_tokenizer(model_id)
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


def reference_config(model_id: str, **overrides):
    """The stand-in for `AutoConfig.from_pretrained(model_id, ...)` (the reward-model scripts): the model type's
    default config with the script's overrides and the reference tokenizer's vocabulary."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"Qwen/Qwen2.5": Qwen2Config, "Qwen/Qwen3": Qwen3Config, "meta-llama/": LlamaConfig}
    prefix = next(prefix for prefix in config_class if model_id.startswith(prefix))
    vocab_size = len(reference_tokenizer(model_id))
    return config_class[prefix](vocab_size=vocab_size, **overrides)


def build_fixtures(checkout: Path, fixtures: Path) -> None:
    """Run TRL's generator scripts with their Hub calls replaced, saving under `fixtures/trl-internal-testing/`."""
    from datasets import Dataset, DatasetDict
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    sys.path.insert(0, str(checkout))
    import scripts.generate_tiny_models._common as common

    organization = fixtures / ORGANIZATION

    def save_model(model, tokenizer, generation_config, prefix=None, suffix=None, create_pr=None):
        name = "-".join(part for part in (prefix, model.__class__.__name__, suffix) if part)
        model.save_pretrained(organization / name)
        tokenizer.save_pretrained(organization / name)
        generation_config.save_pretrained(organization / name)

    common.check_transformers_version = lambda expected_version=None: None
    common.check_dtype_pattern = lambda reference_id, model: None
    common.print_config_diff = lambda reference_id, model: None
    common.push_to_hub = save_model
    AutoTokenizer.from_pretrained = staticmethod(lambda model_id, **kwargs: reference_tokenizer(model_id))
    GenerationConfig.from_pretrained = staticmethod(lambda model_id, **kwargs: reference_generation_config(model_id))
    AutoConfig.from_pretrained = staticmethod(reference_config)
    for script in TINY_MODEL_SCRIPTS:
        runpy.run_module(f"scripts.generate_tiny_models.{script}", run_name="__main__")

    configs: dict[str, list[str]] = {}

    def save_dataset(self, repo_id, config_name="default", **kwargs):
        folder = fixtures / repo_id
        for split, dataset in self.items():
            dataset.to_parquet(str(folder / config_name / f"{split}.parquet"))
        configs.setdefault(repo_id, []).append(config_name)

    DatasetDict.push_to_hub = save_dataset
    Dataset.push_to_hub = lambda self, repo_id, config_name="default", **kwargs: save_dataset(
        {"train": self}, repo_id, config_name
    )
    zen = runpy.run_path(str(checkout / "scripts" / "generate_zen_dataset.py"))
    zen["main"](test_size=0.1, push_to_hub=True, repo_id=f"{ORGANIZATION}/zen")
    for repo_id, names in configs.items():
        card = ["---", "configs:"]
        for name in names:
            splits = sorted(path.stem for path in (fixtures / repo_id / name).glob("*.parquet"))
            card.append(f"- config_name: {name}")
            card.append("  data_files:")
            card += [f"  - split: {split}\n    path: {name}/{split}.parquet" for split in splits]
        (fixtures / repo_id / "README.md").write_text("\n".join(card + ["---", ""]))


def prepare_tests(checkout: Path, work: Path, trainer: str) -> Path:
    """Copy the GRPO tests and their helpers into `work/<trainer>/tests`, substituting the trainer if asked."""
    tests = work / trainer / "tests"
    tests.mkdir(parents=True, exist_ok=True)
    for name in ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py", "test_grpo_trainer.py"):
        shutil.copy(checkout / "tests" / name, tests / name)
    shutil.copytree(checkout / "tests" / "data", tests / "data", dirs_exist_ok=True)
    conftest = tests / "conftest.py"
    conftest.write_text(IMPORT_UTILS_SHIM + conftest.read_text())
    if trainer == "longstraw":
        source = (tests / "test_grpo_trainer.py").read_text()
        if STOCK_IMPORT not in source:
            raise ValueError(f"test_grpo_trainer.py no longer has the line `{STOCK_IMPORT}` this run substitutes")
        (tests / "test_grpo_trainer.py").write_text(source.replace(STOCK_IMPORT, LONGSTRAW_IMPORT))
    return tests


def run_tests(tests: Path, fixtures: Path, report: Path, extra: list[str], only: list[str] | None = None) -> dict:
    """Run pytest on `tests` (the tests named in `only`, else all) from `fixtures`, so that the tests' Hub ids resolve
    to the local folders: `{test: (outcome, first line of its message)}`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(tests.parent)])
    module = tests / "test_grpo_trainer.py"
    selected = [f"{module}::{name}" for name in only] if only is not None else [str(module)]
    if not selected:
        return {}
    command = [sys.executable, "-m", "pytest", *selected, "-p", "no:cacheprovider", "-q", "-o", "addopts="]
    command += ["--rootdir", str(tests.parent), f"--junitxml={report}", *extra]
    subprocess.run(command, cwd=fixtures, env=env, check=False)
    outcomes = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        found = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        message = (found.get("message") or "").splitlines()[0] if found is not None and found.get("message") else ""
        outcomes[name] = (found.tag if found is not None else "passed", message)
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-checkout", required=True, type=Path, help="a clone of the TRL repository")
    parser.add_argument("--work", type=Path, default=Path("outputs/trl_suite"), help="fixtures, test copies, reports")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "trl_suite.md")
    parser.add_argument(
        "--stock",
        choices=("others", "all"),
        default="all",
        help="run stock on every test (default), or only on those that do not pass with LongStraw",
    )
    parser.add_argument(
        "--stock-skip",
        action="append",
        default=[],
        metavar="SUBSTRING",
        help="leave the tests whose id contains SUBSTRING out of the stock run (repeatable; reported as not run)",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (e.g. -k test_train)")
    args = parser.parse_args()
    checkout, work = args.trl_checkout.resolve(), args.work.resolve()
    fixtures = work / "fixtures"
    if not (fixtures / ORGANIZATION).exists():
        build_fixtures(checkout, fixtures)
    tests = prepare_tests(checkout, work, "longstraw")
    longstraw = run_tests(tests, fixtures, work / "longstraw.xml", args.pytest_args)
    selected = [
        name
        for name, (outcome, _) in longstraw.items()
        if (args.stock == "all" or outcome != "passed") and not any(part in name for part in args.stock_skip)
    ]
    stock = run_tests(prepare_tests(checkout, work, "stock"), fixtures, work / "stock.xml", args.pytest_args, selected)
    (work / "outcomes.json").write_text(json.dumps({"longstraw": longstraw, "stock": stock}, indent=1))
    write_table(longstraw, stock, checkout, args.output, args.stock_skip)


def write_table(longstraw: dict, stock: dict, checkout: Path, output: Path, stock_skip: list[str]) -> None:
    """The report: LongStraw's outcomes, and stock's on the tests it was run on (`stock` may hold fewer tests, those
    `stock_skip` left out)."""

    def outcome(results: dict, name: str) -> str:
        return results[name][0] if name in results else "not run"

    passing = [name for name in longstraw if outcome(longstraw, name) == "passed"]
    missed = [name for name in longstraw if outcome(stock, name) == "passed" and name not in passing]
    both = [name for name in passing if outcome(stock, name) == "passed"]
    only_longstraw = [name for name in passing if outcome(stock, name) not in ("passed", "not run")]
    unchecked = [name for name in passing if outcome(stock, name) == "not run"]
    neither = [name for name in longstraw if name not in passing and name not in missed]
    counts = {kind: sum(outcome(longstraw, name) == kind for name in longstraw) for kind in ("failure", "skipped")}
    revision = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    stock_passing = len(both) + len(missed)
    lines = [
        "# TRL's GRPO tests with LongStraw substituted",
        "",
        "```",
        "PYTHONPATH=. .venv/bin/python benchmarks/trl_suite.py --trl-checkout PATH/TO/trl"
        + "".join(f" \\\n    --stock-skip '{part}'" for part in stock_skip),
        "```",
        "",
        (
            f"`tests/test_grpo_trainer.py` of TRL at commit {revision or '(unknown)'}, on CPU, against "
            f"trl {_version('trl')} and transformers {_version('transformers')}: {len(longstraw)} tests. With "
            f"`LongStrawGRPOTrainer` substituted: {len(passing)} pass, {counts['failure']} fail, {counts['skipped']} "
            f"are skipped (TRL's own markers: liger-kernel, vLLM, an accelerator or `kernels` absent; the same on "
            f"stock). Stock `GRPOTrainer` ran on {len(stock)} of them and passes {stock_passing}; **{len(both)} of "
            f"those {stock_passing} pass with LongStraw.**"
        ),
        "",
        "Passing on stock, not with LongStraw:",
        "",
        *([f"- `{name}`: {longstraw[name][1]}" for name in missed] or ["- none"]),
        "",
        "Passing with LongStraw, failing on stock:",
        "",
        *([f"- `{name}`: {stock[name][1]}" for name in only_longstraw] or ["- none"]),
        "",
        "Passing with LongStraw, not run on stock (`--stock-skip`):",
        "",
        *([f"- `{name}`" for name in unchecked] or ["- none"]),
        "",
        "Passing on neither (LongStraw's outcome and message; stock's where it ran):",
        "",
        *[
            f"- `{name}`: {longstraw[name][0]}: {longstraw[name][1]}"
            + (f" (stock: {stock[name][0]}: {stock[name][1]})" if name in stock else "")
            for name in neither
            if longstraw[name][0] != "skipped"
        ],
    ]
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
