"""Evaluation shared by the small-scale study, the recipes and the benchmarks: the arithmetic task with
its one split rule (`arithmetic`, `char_tokenizer`), measuring a model (`measure`), scoring
(`scoring`), how result rows record a decoding setting (`recorded`), resumable evaluation entries (`entries`) and the
stamped result writer (`results`)."""
