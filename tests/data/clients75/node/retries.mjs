// How many times each library sends a request the server answers 504 with x-should-retry:
// false (the request's own deadline, a body timeout of 1e-6 s), with its default retries.
import { generateText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { ChatOpenAI } from "@langchain/openai";
import OpenAI from "openai";
import { BASE, MODEL, step, done } from "./common.mjs";

let sent = 0;
const counting = (url, init) => { sent++; return fetch(url, init); };
const body = { timeout: 1e-6 };
await step("retry.openai_js", async () => {
  sent = 0; const t0 = Date.now();
  const c = new OpenAI({ baseURL: BASE, apiKey: "none", fetch: counting });
  try { await c.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 4, ...body }); }
  catch (e) { return { status: e.status, sent, ms: Date.now() - t0 }; }
});
await step("retry.vercel_ai", async () => {
  sent = 0; const t0 = Date.now();
  const openai = createOpenAI({ baseURL: BASE, apiKey: "none", fetch: async (url, init) => {
    const b = JSON.parse(init.body); return counting(url, { ...init, body: JSON.stringify({ ...b, ...body }) }); } });
  try { await generateText({ model: openai.chat(MODEL), prompt: "hi", maxOutputTokens: 4 }); }
  catch (e) { return { cls: e.constructor.name, status: e.lastError?.statusCode ?? e.statusCode, sent, ms: Date.now() - t0, reason: e.reason }; }
});
await step("retry.langchain_js", async () => {
  sent = 0; const t0 = Date.now();
  const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 4, maxRetries: 2, modelKwargs: body,
    configuration: { baseURL: BASE, fetch: counting } });
  try { await m.invoke("hi"); } catch (e) { return { cls: e.constructor.name, status: e.status, sent, ms: Date.now() - t0 }; }
});
done();
