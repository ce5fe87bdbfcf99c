"""`tokenpipe local`: an OpenAI-compatible server over the embedded Gemma 3 270M (llama.cpp, CPU).

One model instance decodes one sequence at a time. Requests wait in a bounded, fair queue
(`queue.py`); the decode thread hands tokens to the event loop through a bounded hand-off
(`handoff.py`), so decoding pauses while the client is not reading and stops at once when it
goes away (`decode.py`); `app.py` holds the HTTP routes (request bodies in `schema.py`, response
bytes in `responses.py`) and `model.py` finds and loads the GGUF.
"""
