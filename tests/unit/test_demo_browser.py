"""What the trace-UI test calls "shown": a rendered DOM's text nodes, never its scripts, styles or attributes."""

from __future__ import annotations

from gateway.demo import browser


def test_visible_text_is_the_text_a_page_shows_not_its_scripts_styles_or_attributes() -> None:
    dom = (
        '<html><head><style>.span { content: "stage.auth" }</style>'
        '<script>window.spans = ["engine.decode"]</script></head>'
        '<body><div title="stage.guard">stage.parse</div><ul><li> engine.prefill </li></ul>'
        "<template><p>engine.queue</p></template><noscript>enable scripts</noscript><p>after</p></body></html>"
    )
    assert browser.visible_text(dom).splitlines() == ["stage.parse", "engine.prefill", "after"]
