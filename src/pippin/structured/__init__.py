"""Structured output: JSON schemas, regexes, choices, grammars and forced tool calls,
enforced while decoding by token masks from llguidance.

What the API layers call (OpenAI chat, completions, Responses, Anthropic messages):

- `formats.response_format_grammar(fmt, param)`: an OpenAI `response_format` (or the
  Responses API's `text.format`) -> `GrammarSpec | None`.
- `formats.guided_grammar(...)`: vLLM's `guided_json` / `guided_regex` / `guided_choice` /
  `guided_grammar` / `structured_outputs` -> `GrammarSpec | None`.
- `tool_calls.forced_tool_grammar(parser, tools, name, ...)`: a forced tool call in the
  model family's own format -> `GrammarSpec`.
- `compiler.GrammarCompiler.constraint(spec, gate)`: compiles a spec for the model's
  vocabulary (off the event loop, with a timeout) -> `Constraint`, which goes into
  `SamplingParams.constraint`.

Every problem is a `StructuredOutputError` naming the request field (`param`), which each
API turns into its own 400 body. The engine side (`engine/grammar_masks`) keeps one matcher per
sequence and computes the masks of a step while the model runs.
"""
