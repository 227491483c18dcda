"""The reference pages' generated parts, from the same sources as `python -m xtrain --help`: written into the
pages in the repository (`python docs/hooks.py`; tests/test_docs.py fails where they are out of date), and
written anew as the site builds (an MkDocs hook)."""

from pathlib import Path

from xtrain.commands import help

PAGES = ("reference/config.md", "reference/cli.md")


def on_page_markdown(markdown: str, **kwargs) -> str:
    return help.refreshed(markdown)


if __name__ == "__main__":
    for page in PAGES:
        path = Path(__file__).parent / page
        path.write_text(help.refreshed(path.read_text()))
