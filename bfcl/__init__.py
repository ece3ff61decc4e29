"""The shared BFCL layer: corpus, conversion to OpenAI tools, answer decoding, language types, the
multi-turn API simulators, case look-ups and sentence embeddings. Perturbers and scorers both stand
on it; it imports nothing else of toolquake's."""
