"""The benchmarks' one way to write their section of docs/benchmarks.md."""
from batchtop.engine.bench.figures import publish, write_section


def test_a_section_is_replaced_in_place_or_appended_and_the_others_stay(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nintro\n\n## A\n\nold a\n\n## B\n\nold b\n")
    write_section("## A", "## A\n\nnew a\n", doc)
    write_section("## C", "## C\n\nc", doc)
    write_section("## B", "## B\n\nnew b\n", doc)
    assert doc.read_text() == "# Benchmarks\n\nintro\n\n## A\n\nnew a\n\n## B\n\nnew b\n\n## C\n\nc\n"


def test_the_default_page_is_the_repositorys_docs_benchmarks_md():
    from pathlib import Path

    from batchtop.engine.bench.figures import DOCS
    assert DOCS == Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
    assert DOCS.read_text().startswith("# Benchmarks\n")


def test_publish_prints_and_writes_only_when_asked(tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n")
    assert publish("## A", "## A\n\nnew a\n", write=False, doc=doc) == 0
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nold a\n"
    publish("## A", "## A\n\nnew a\n", write=True, doc=doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n"
    assert capsys.readouterr().out == "## A\n\nnew a\n\n" * 2
