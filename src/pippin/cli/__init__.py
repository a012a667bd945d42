"""Command line: ``pippin serve [MODEL]``, ``pippin bench`` and ``pippin --version``.

`main` builds the parser and runs the command; `pippin serve`'s flags live one module per
group (`*_flags.py`, each with the settings its flags give), `settings` turns them into
`ServerSettings` and `serve` starts the server. Flag names follow pippin's own vocabulary;
the names vLLM and vllm-mlx use for the same settings are accepted as aliases so existing
launch scripts keep working. Flags whose meaning differs in those servers are not aliased.
"""
