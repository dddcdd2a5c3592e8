"""MkDocs hook: the config reference page's marker replaced by the tables generated from
the config dataclasses (`mcore_rl.config.reference`)."""
MARKER = "<!-- config reference -->"


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    from mcore_rl.config.reference import config_reference_markdown

    return markdown.replace(MARKER, config_reference_markdown())
