"""The docs against the code and against themselves: the configuration reference documents every LongStraw field with
its default, the README stays a front page, every relative link resolves, and no page narrates how it was written."""

import ast
import dataclasses
import re
import runpy
from pathlib import Path

import pytest
from trl import GRPOConfig

from trl_longstraw.config import LongStrawGRPOConfig

REPOSITORY = Path(__file__).resolve().parents[1]
DOCS = REPOSITORY / "docs"
CONFIGURATION = DOCS / "configuration.md"
README = REPOSITORY / "README.md"
PAGES = [README, REPOSITORY / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 250
FORBIDDEN = ("this session", "latest session", "../" + "shared")  # spelled so that this file does not match itself
# How the work went, which the README and docs/ do not tell (the changelog says what changed, by nature)
NARRATION = ("not met", "no longer", "before the fix", "went from", "used to", "an earlier session", "busier machine")

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
BACKTICKED = re.compile(r"^`([A-Za-z_][A-Za-z0-9_]*)`$")
FIGURE = re.compile(
    r"(?<![\w./-])(?<!PEFT )(?<!torch )(?<!transformers )(?<!trl )(\d+\.\d+|1/\d+(?:\.\d+)?)(?!\.\d|[a-wyzA-Z0-9_/])"
)  # 0.471, 1/19.4; not a version
RESULT_FILE = re.compile(r"`(benchmarks/results/[^`\s]+\.md)`")


def page_id(path: Path) -> str:
    return str(path.relative_to(REPOSITORY))


def prose(text: str) -> str:
    """The text outside fenced code blocks, where a link or a heading means one."""
    return FENCE.sub("", text)


def table_rows(text: str) -> list[dict[str, str]]:
    """Every row of every markdown table whose header starts with `field | default`, as {header cell: cell}."""
    rows, header = [], None
    for line in prose(text).splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            rows.append(dict(zip(header, cells)))
    return [row for row in rows if list(row)[:2] == ["field", "default"]]


def documented_fields() -> dict[str, dict[str, str]]:
    """The configuration reference's field rows, keyed by the field name its first cell holds in backticks."""
    fields = {}
    for row in table_rows(CONFIGURATION.read_text()):
        name = BACKTICKED.match(row["field"])
        assert name, f"docs/configuration.md: a field cell must be one `name` in backticks, got {row['field']!r}"
        fields[name.group(1)] = row
    return fields


def literal(cell: str):
    """A default cell: one Python literal in backticks."""
    assert cell.startswith("`") and cell.endswith("`"), f"a default must be a Python literal in backticks: {cell!r}"
    return ast.literal_eval(cell.strip("`"))


def defaults(config_class) -> dict[str, object]:
    return {field.name: field.default for field in dataclasses.fields(config_class)}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercased, punctuation but `-` and `_` dropped, spaces as `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(path.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)  # http:, https:, mailto:, ...
    ]


# ---------------------------------------------------------------------------------------------------------------------
# The configuration reference
# ---------------------------------------------------------------------------------------------------------------------
def test_every_field_longstraw_adds_is_in_the_configuration_reference():
    text = CONFIGURATION.read_text()
    added = sorted(set(defaults(LongStrawGRPOConfig)) - set(defaults(GRPOConfig)))
    missing = [name for name in added if f"`{name}`" not in text]
    assert added and not missing, f"docs/configuration.md does not document {missing}"


def test_every_grpo_default_longstraw_overrides_is_in_the_configuration_reference():
    ours, trls = defaults(LongStrawGRPOConfig), defaults(GRPOConfig)
    overridden = sorted(name for name in trls if ours[name] != trls[name])
    missing = [name for name in overridden if name not in documented_fields()]
    assert overridden and not missing, f"docs/configuration.md does not list the overridden defaults {missing}"


def test_every_documented_field_exists_on_the_config():
    unknown = sorted(set(documented_fields()) - set(defaults(LongStrawGRPOConfig)))
    assert not unknown, f"docs/configuration.md documents fields LongStrawGRPOConfig does not have: {unknown}"


def test_documented_defaults_are_the_dataclass_defaults():
    ours = defaults(LongStrawGRPOConfig)
    wrong = {
        name: (row["default"], ours[name])
        for name, row in documented_fields().items()
        if name in ours and literal(row["default"]) != ours[name]
    }
    assert not wrong, f"docs/configuration.md's defaults differ from the code's (documented, actual): {wrong}"


def test_documented_grpo_defaults_are_trls():
    trls = defaults(GRPOConfig)
    rows = {name: row for name, row in documented_fields().items() if "GRPOConfig default" in row}
    wrong = {
        name: (row["GRPOConfig default"], trls.get(name))
        for name, row in rows.items()
        if name not in trls or literal(row["GRPOConfig default"]) != trls[name]
    }
    assert rows and not wrong, f"docs/configuration.md's GRPOConfig defaults differ from TRL's: {wrong}"


# ---------------------------------------------------------------------------------------------------------------------
# The README is a front page
# ---------------------------------------------------------------------------------------------------------------------
def test_readme_is_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {README_MAX_LINES})"


@pytest.mark.parametrize("command", ["make demo", "make test"])
def test_readme_gives_the_two_commands(command):
    assert command in README.read_text()


def test_supported_models_lists_the_readmes_families_table():
    def families_table(text: str) -> str:
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("| family | `model_type` |"))
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        return "\n".join(lines[start:end])

    readme = families_table(README.read_text())
    assert families_table((DOCS / "supported-models.md").read_text()) == readme, (
        "docs/supported-models.md's families table differs from README.md's (both are "
        "`python -m trl_longstraw.architectures`)"
    )


def test_the_conformance_counts_are_the_tables():
    """README.md and docs/supported-models.md quote benchmarks/results/conformance.md's counts: one source."""
    table = (REPOSITORY / "benchmarks" / "results" / "conformance.md").read_text()
    counts = {
        status: int(n)
        for status, n in re.findall(r"^\| (verified|refused|verified, exact mode) \| (\d+) \|", table, re.MULTILINE)
    }
    accepted = sum(counts.values())
    readme = " ".join(README.read_text().split())
    assert f"({accepted} of transformers' causal LMs)" in readme
    assert f"{counts['verified']} verified, {counts['verified, exact mode']} verified in exact mode" in readme
    assert f"and {counts['refused']} refused" in readme
    supported = " ".join((DOCS / "supported-models.md").read_text().split())
    assert f"({accepted} accepted types): {counts['verified']} verified" in supported
    assert f"{counts['verified, exact mode']} verified in exact mode only" in supported
    assert f"{counts['refused']} refused" in supported


def test_the_readmes_headline_table_is_the_update_benchmarks_summary():
    """Each figure of the front page's table is the result file's, rounded as printed."""
    summary = (REPOSITORY / "benchmarks" / "results" / "cpu-2core" / "summary.md").read_text()
    measured = {}
    for line in summary.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 12 and cells[2] == "ok" and (cells[0], cells[1]) not in (("longstraw-detach", "on"),):
            measured[cells[0]] = {"peak": cells[3], "time": cells[4], "norm": cells[9], "ratios": cells[10:12]}
    modes = {
        "stock batched": "stock-batched",
        "stock serialized": "stock-serialized",
        "Prefix Grouper": "prefix-grouper",
        "naive capture-and-replay": "reference",
        "LongStraw detach": "longstraw-detach",
        "LongStraw exact": "longstraw-exact",
    }
    rows = [
        line for line in README.read_text().splitlines() if re.match(r"^\| \**(stock|Prefix|naive|LongStraw)", line)
    ]
    assert len(rows) == len(modes), rows
    for row in rows:
        label, peak, time, ratios, norm = (cell.strip().strip("*") for cell in row.strip().strip("|").split("|"))
        mode = measured[next(key for name, key in modes.items() if label.startswith(name))]

        def printed_as(figure: str, value: str) -> bool:
            decimals = len(figure.partition(".")[2])
            return f"{float(value):.{decimals}f}" == figure

        assert printed_as(peak, mode["peak"]) and printed_as(time, mode["time"]) and printed_as(norm, mode["norm"]), (
            row
        )
        if ratios != "1, 1":
            for figure, value in zip(re.findall(r"[\d.]+(?=x)", ratios), mode["ratios"], strict=True):
                assert printed_as(figure, value), (row, figure, value)


def quotes(figure: str, figures: set[str]) -> bool:
    """`figure` is one of `figures` as printed or rounded (94.5 quotes 94.51; it does not quote 194.5 or 94.56)."""
    prefix, _, number = figure.rpartition("/")
    decimals = len(number.partition(".")[2])
    return any(
        other.rpartition("/")[0] == prefix and f"{float(other.rpartition('/')[2]):.{decimals}f}" == number
        for other in figures
    )


@pytest.mark.parametrize(
    "page", [README, *(p for p in sorted(DOCS.glob("*.md")) if p.name != "simulation-results.md")], ids=page_id
)
def test_figures_beside_a_result_file_are_that_files(page):
    """A paragraph that names a result file under benchmarks/results/ quotes it: each decimal figure in the paragraph
    (0.471, 1/19.4) is in that file, or printed in a code block of the same page. One source for each figure."""
    text = page.read_text()
    printed = " ".join(block.group(0) for block in FENCE.finditer(text))
    stale = []
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*(?:-|\d+\.) )", prose(text)):  # paragraphs and list items
        files = [page.parent / target.split("#")[0] for target in LINK.findall(paragraph)]
        files += [REPOSITORY / name for name in RESULT_FILE.findall(paragraph)]
        files = [path for path in files if "benchmarks/results/" in path.as_posix() and path.suffix == ".md"]
        if files:
            source = printed + " ".join(path.read_text() for path in files if path.exists())
            quoted = set(FIGURE.findall(source))
            stale += [(figure, paragraph[:60]) for figure in FIGURE.findall(paragraph) if not quotes(figure, quoted)]
    assert not stale, f"{page_id(page)}: figures not in the result file their paragraph names: {stale}"


# ---------------------------------------------------------------------------------------------------------------------
# Links and wording
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_point_at_existing_files(page):
    broken = [
        target
        for target in relative_links(page)
        if not target.startswith("#") and not (page.parent / target.split("#")[0]).exists()
    ]
    assert not broken, f"{page_id(page)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_anchors_point_at_existing_headings(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = page if not path else page.parent / path
        if anchor and linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page_id(page)} links to headings that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_pages_do_not_narrate_how_they_were_written(page):
    text = " ".join(page.read_text().lower().split())
    found = [phrase for phrase in FORBIDDEN if phrase in text]
    found += [phrase for phrase in NARRATION if phrase in text and page.name != "CHANGELOG.md"]
    assert not found, f"{page_id(page)} contains {found}: say what the software does and what was measured"


def test_the_readmes_quick_start_runs_as_written_on_a_tiny_model(tmp_path, monkeypatch):
    """The quick start's code, complete as printed, with only the Hub model and dataset swapped for a tiny model
    saved to disk and 8 in-memory prompts, and one short step."""
    from datasets import Dataset

    from trl_longstraw.embedded import build_model, build_tokenizer

    code = re.search(r"## Quick start\n\n```python\n(.*?)```", README.read_text(), re.DOTALL).group(1)
    model = tmp_path / "model"
    build_model("qwen3", seed=0).save_pretrained(model)
    build_tokenizer().save_pretrained(model)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {word}"}] for word in "abcdefgh"]})
    monkeypatch.setattr("datasets.load_dataset", lambda *args, **kwargs: prompts)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    settings = (
        f"output_dir={str(tmp_path / 'out')!r}, max_steps=1, max_completion_length=4, use_cpu=True, bf16=False, "
        "report_to='none', save_strategy='no'"
    )
    for hub, local in (('"Qwen/Qwen3-8B"', repr(str(model))), ('output_dir="out"', settings)):
        assert hub in code
        code = code.replace(hub, local)
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    namespace = runpy.run_path(str(script))
    assert namespace["trainer"].state.global_step == 1
