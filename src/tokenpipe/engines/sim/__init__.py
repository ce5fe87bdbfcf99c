"""`tokenpipe sim`: a simulated OpenAI-compatible upstream with exact, seeded timing and faults."""
