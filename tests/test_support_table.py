"""The README's support table is the one the registry generates (`python -m trl_longstraw.architectures`)."""

from pathlib import Path

from trl_longstraw.architectures import support_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_support_table_is_generated_from_the_registry():
    assert support_table() in README.read_text(), (
        "README.md's support table differs from the registry's: paste the output of "
        "`python -m trl_longstraw.architectures` into its 'Support' section."
    )
