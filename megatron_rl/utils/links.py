"""How text writes a page's link: `[title](URL)` or `<URL>`. A target runs to its closing
bracket, not to the first space: a generated world's URL spells its page's title, spaces
included (`data/world.py`)."""

MARKDOWN_URL = r"https?://[^)\n]+"  # the target inside `(...)`
ANGLE_URL = r"https?://[^>\n]+"     # the target inside `<...>`
