// Error bodies, mid-stream failures and cancels as the JS libraries read them. CALEXEC_URL: a
// server with ServerConfig defaults; CALEXEC_URL3: one with default_timeout_s 1 (a long stream
// fails mid-way on its deadline).
import OpenAI from "openai";
import { generateText, streamText, APICallError } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { ChatOpenAI } from "@langchain/openai";
import { URL_, BASE, MODEL, step, check, done } from "./common.mjs";

const BASE3 = `${process.env.CALEXEC_URL3}/v1`;
const metric = async (url, name) => {
  const t = await (await fetch(`${url}/metrics`)).text();
  const line = t.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line ? Number(line.split(" ").pop()) : null;
};
const waitIdle = async (url = URL_) => {
  for (let i = 0; i < 100; i++) {
    if ((await metric(url, "calexec_num_requests_running")) === 0) return true;
    await new Promise((r) => setTimeout(r, 50));
  }
  return false;
};
const providers = (base) => ({
  resp: createOpenAI({ baseURL: base, apiKey: "none" })(MODEL),
  chat: createOpenAI({ baseURL: base, apiKey: "none" }).chat(MODEL),
  compat: createOpenAICompatible({ name: "calexec", baseURL: base, includeUsage: true }).chatModel(MODEL),
});
const P = providers(BASE), P3 = providers(BASE3);
const errInfo = (e) => ({ cls: e?.constructor?.name, status: e?.statusCode ?? e?.status, message: String(e?.message).slice(0, 300),
  retryable: e?.isRetryable, data: e?.data, cause: e?.cause?.constructor?.name, lastError: e?.lastError?.message?.slice?.(0, 200) });

// a 400 naming its field, as each library reports it
for (const [k, model] of Object.entries(P)) {
  await step(`more.${k}.400`, async () => {
    try { await generateText({ model, prompt: "hi", temperature: 5, maxRetries: 0 }); }
    catch (e) {
      check(APICallError.isInstance(e) && e.statusCode === 400, "400 APICallError");
      check(String(e.message).includes("temperature"), "message names the field: " + e.message);
      check(e.isRetryable === false, "400 not retryable");
      return errInfo(e);
    }
    check(false, "no error");
  });
  await step(`more.${k}.multiturn`, async () => {
    const r = await generateText({ model, maxOutputTokens: 8, maxRetries: 0, messages: [
      { role: "system", content: "be brief" }, { role: "user", content: "hi" },
      { role: "assistant", content: "hello" }, { role: "user", content: "again" }] });
    return { text: r.text, finish: r.finishReason, warnings: r.warnings };
  });
  await step(`more.${k}.midstream_deadline`, async () => {
    const r = streamText({ model: P3[k], prompt: "hi", maxOutputTokens: 3000, maxRetries: 0, onError: () => {} });
    const kinds = {}; let err = null;
    for await (const p of r.fullStream) { kinds[p.type] = (kinds[p.type] ?? 0) + 1; if (p.type === "error") err = p.error; }
    let finish = null; try { finish = await r.finishReason; } catch (e) { finish = "threw " + e.constructor.name; }
    check(err !== null, "an error part");
    check(finish === "error" || String(finish).startsWith("threw"), "finish says error: " + finish);
    return { kinds, finish, err: errInfo(err) };
  });
  await step(`more.${k}.abort`, async () => {
    const ac = new AbortController();
    const r = streamText({ model, prompt: "hi", maxOutputTokens: 3000, maxRetries: 0, abortSignal: ac.signal,
      onError: () => {}, providerOptions: {} });
    let n = 0, aborted = null;
    try { for await (const t of r.textStream) if (++n === 5) ac.abort(); } catch (e) { aborted = e.constructor.name; }
    const idle = await waitIdle();
    check(idle, "idle after abort");
    return { n, aborted, idle };
  });
}
await step("more.resp.store_true_tools", async () => {
  const { tool, stepCountIs } = await import("ai");
  const { z } = await import("zod");
  const weather = tool({ inputSchema: z.object({ city: z.string().max(8) }), execute: async ({ city }) => "sunny" });
  const r = await generateText({ model: P.resp, prompt: "weather?", tools: { weather }, toolChoice: "required",
    stopWhen: stepCountIs(2), maxOutputTokens: 256, maxRetries: 0, providerOptions: { openai: { store: true } } });
  return r.steps.map((s) => s.finishReason);
});
// the provider's default store (true) sends an earlier answer's assistant turn as an
// item_reference, which a server storing nothing refuses (400 naming input.1.type and the fix)
await step("more.resp.store_true_multiturn", async () => {
  const r1 = await generateText({ model: P.resp, prompt: "hi", maxOutputTokens: 8, maxRetries: 0 });
  try {
    await generateText({ model: P.resp, maxOutputTokens: 8, maxRetries: 0,
      messages: [{ role: "user", content: "hi" }, ...r1.response.messages, { role: "user", content: "more" }] });
  } catch (e) {
    check(e.statusCode === 400 && e.message.includes("providerOptions.openai.store"), "item_reference 400");
    return { status: e.statusCode, message: e.message };
  }
  check(false, "an item_reference answered");
});
await step("more.resp.store_false_multiturn", async () => {
  const opts = { openai: { store: false } };
  const r1 = await generateText({ model: P.resp, prompt: "hi", maxOutputTokens: 8, maxRetries: 0, providerOptions: opts });
  const r2 = await generateText({ model: P.resp, maxOutputTokens: 8, maxRetries: 0, providerOptions: opts,
    messages: [{ role: "user", content: "hi" }, ...r1.response.messages, { role: "user", content: "more" }] });
  return [r1.finishReason, r2.finishReason];
});
// openai-node: a mid-stream error event, chat and Responses
const sdk3 = new OpenAI({ baseURL: BASE3, apiKey: "none", maxRetries: 0 });
await step("more.sdk.midstream_chat", async () => {
  const s = await sdk3.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 3000,
    ignore_eos: true, stream: true });
  let n = 0;
  try { for await (const c of s) n++; } catch (e) {
    check(e instanceof OpenAI.APIError, "APIError"); return { n, cls: e.constructor.name, status: e.status, code: e.code, message: e.message, type: e.type };
  }
  check(false, "no error after " + n);
});
await step("more.sdk.midstream_responses", async () => {
  const s = await sdk3.responses.create({ model: MODEL, input: "hi", max_output_tokens: 3000, stream: true });
  const types = {};
  let last;
  try { for await (const e of s) { types[e.type] = (types[e.type] ?? 0) + 1; last = e; } } catch (e) {
    return { threw: e.constructor.name, message: e.message, types };
  }
  return { types, last: last.type, error: last.response?.error };
});
await step("more.sdk.midstream_responses.helper", async () => {
  const s = sdk3.responses.stream({ model: MODEL, input: "hi", max_output_tokens: 3000 });
  try { const f = await s.finalResponse(); return { status: f.status, error: f.error }; }
  catch (e) { return { threw: e.constructor.name, message: e.message }; }
});
await step("more.lc.midstream", async () => {
  const out = {};
  for (const useResponsesApi of [false, true]) {
    const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 3000, maxRetries: 0, useResponsesApi,
      configuration: { baseURL: BASE3 } });
    let n = 0;
    // @langchain/openai 1.5.8 reads no response.failed event: its Responses stream just ends
    try { for await (const c of await m.stream("hi")) n++; out[useResponsesApi] = { n, threw: null }; check(useResponsesApi, "lc no error " + useResponsesApi); }
    catch (e) { out[useResponsesApi] = { n, threw: e.constructor.name, message: e.message.slice(0, 200) }; }
  }
  return out;
});
await step("more.lc.abort", async () => {
  const out = {};
  for (const useResponsesApi of [false, true]) {
    const ac = new AbortController();
    const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 3000, maxRetries: 0, useResponsesApi,
      configuration: { baseURL: BASE } });
    let n = 0, threw = null;
    try { for await (const c of await m.stream("hi", { signal: ac.signal })) if (++n === 5) ac.abort(); }
    catch (e) { threw = e.constructor.name; }
    out[useResponsesApi] = { n, threw, idle: await waitIdle() };
    check(out[useResponsesApi].idle, "idle");
  }
  return out;
});
await step("more.lc.400", async () => {
  const m = new ChatOpenAI({ model: MODEL, apiKey: "none", temperature: 5, maxRetries: 0, configuration: { baseURL: BASE } });
  try { await m.invoke("hi"); } catch (e) { return { cls: e.constructor.name, status: e.status, message: e.message, code: e.lc_error_code }; }
});
done();
