from bench.kv_timeline import format_timeline, timeline_rows


def test_rows_are_offsets_from_the_first_mark_and_steps_from_the_previous():
    marks = [("start", 10.0), ("header", 10.0005), ("copied", 10.002)]
    rows = [(name, round(at_ms, 6), round(step_ms, 6)) for name, at_ms, step_ms in timeline_rows(marks)]
    assert rows == [("start", 0.0, 0.0), ("header", 0.5, 0.5), ("copied", 2.0, 1.5)]


def test_no_marks_no_rows():
    assert timeline_rows([]) == []
    assert format_timeline("empty", []).splitlines()[0] == "empty"


def test_the_table_names_every_event_in_order():
    text = format_timeline("t", [("start", 1.0), ("lease_held", 1.001), ("copied", 1.003)])
    assert [line.split()[0] for line in text.splitlines()[2:]] == ["start", "lease_held", "copied"]
