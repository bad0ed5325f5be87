"""docs/settings.md is what scripts/gen_settings_doc.py writes from the configuration dataclasses:
a setting added, removed, renamed or given another default in code without the page following it
fails here, and every setting the page lists says what it does."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_settings_doc  # scripts/ is no package


def test_the_settings_page_is_generated_from_the_code() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == gen_settings_doc.render(), "docs/settings.md is out of date: run scripts/gen_settings_doc.py"


def test_every_setting_says_what_it_does() -> None:
    undocumented = [
        f"{cls.__name__}.{f.name}" for cls in gen_settings_doc.config_classes() for f in dataclasses.fields(cls)
        if not f.name.startswith("_") and f.name not in gen_settings_doc.attribute_docs(cls)]
    assert undocumented == [], f"settings without a line in their class's Attributes: {undocumented}"
