// Streams one answer through the gateway with each JavaScript client, and prints one JSON
// line per client: what it got (deltas, text, finish, usage, error).
//
//   node clients.mjs BASE_URL MODEL [CLIENT...]
//
// BASE_URL is the gateway's root (http://127.0.0.1:8000); CLIENT is `ai-sdk` (the Vercel
// AI SDK's default provider `openai(model)`, which calls /v1/responses) or `anthropic`
// (`messages.stream` on /v1/messages); both when none is named. The exit status is 0 even
// when a client failed: the test reads the error from the JSON.

import Anthropic from "@anthropic-ai/sdk";
import { createOpenAI } from "@ai-sdk/openai";
import { streamText } from "ai";

const PROMPT = "Say hello in five words.";
const MAX_TOKENS = 16;

async function aiSdk(baseURL, model) {
  const openai = createOpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused" });
  const got = { client: "ai-sdk", deltas: 0, text: "", finish: null, usage: null, error: null };
  const result = streamText({
    model: openai(model), // the default provider: the Responses API
    prompt: PROMPT,
    maxOutputTokens: MAX_TOKENS,
    maxRetries: 0,
  });
  // fullStream yields errors as parts (the SDK does not throw them).
  for await (const part of result.fullStream) {
    if (part.type === "text-delta") {
      got.deltas += 1;
      got.text += part.text;
    } else if (part.type === "finish") {
      got.finish = part.finishReason;
      got.usage = part.totalUsage;
    } else if (part.type === "error") {
      got.error = String(part.error?.message ?? part.error);
    }
  }
  return got;
}

async function anthropic(baseURL, model) {
  const client = new Anthropic({ baseURL, apiKey: "unused", maxRetries: 0 });
  const got = { client: "anthropic", deltas: 0, text: "", finish: null, usage: null, error: null };
  const stream = client.messages.stream({
    model,
    max_tokens: MAX_TOKENS,
    messages: [{ role: "user", content: PROMPT }],
  });
  for await (const event of stream) {
    if (event.type === "content_block_delta" && event.delta.type === "text_delta") {
      got.deltas += 1;
      got.text += event.delta.text;
    }
  }
  const final = await stream.finalMessage();
  got.finish = final.stop_reason;
  got.usage = final.usage;
  return got;
}

const CLIENTS = { "ai-sdk": aiSdk, anthropic };
const [baseURL, model, ...names] = process.argv.slice(2);
if (!baseURL || !model) {
  console.error("usage: node clients.mjs BASE_URL MODEL [ai-sdk|anthropic ...]");
  process.exit(2);
}
for (const name of names.length ? names : Object.keys(CLIENTS)) {
  let got;
  try {
    got = await CLIENTS[name](baseURL, model);
  } catch (e) {
    got = { client: name, deltas: 0, text: "", finish: null, usage: null, error: String(e) };
  }
  console.log(JSON.stringify(got));
}
