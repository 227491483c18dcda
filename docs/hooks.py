"""MkDocs hook: the reference pages' generated parts, from the same sources as `python -m xtrain --help`."""

from xtrain.commands import help


def on_page_markdown(markdown: str, **kwargs) -> str:
    return (markdown.replace("<!-- xtrain:config-reference -->", help.reference())
            .replace("<!-- xtrain:help -->", help.text()))
