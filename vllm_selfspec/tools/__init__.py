"""The tools that run engines as a user would: the benchmark harness, the demo, vLLM's OpenAI
server on loopback and its load test, output-quality scoring, and the prompt sets they share
(heads training reads those prompt sets too)."""
