// The `openai` npm package's error, retry and cancel paths against a server started with
// api_key "sekrit", max_sequences 1, max_waiting 0 (so a second request meets a 429).
import OpenAI from "openai";
import { URL_, BASE, MODEL, step, check, done } from "./common.mjs";

const client = new OpenAI({ baseURL: BASE, apiKey: "sekrit", maxRetries: 2 });
const metric = async (name) => {
  const t = await (await fetch(`${URL_}/metrics`, { headers: { authorization: "Bearer sekrit" } })).text();
  const line = t.split("\n").find((l) => l.startsWith(name + " ") || l.startsWith(name + "{"));
  return line ? Number(line.split(" ").pop()) : null;
};
const waitIdle = async () => {
  for (let i = 0; i < 100; i++) {
    if ((await metric("calexec_num_requests_running")) === 0) return true;
    await new Promise((r) => setTimeout(r, 50));
  }
  return false;
};
const asErr = (e) => ({ cls: e.constructor.name, status: e.status, code: e.code, param: e.param, type: e.type,
  message: e.message, requestID: e.requestID ?? e.request_id, error: e.error,
  retryAfter: e.headers?.get?.("retry-after"), shouldRetry: e.headers?.get?.("x-should-retry") });

await step("err.badkey", async () => {
  const bad = new OpenAI({ baseURL: BASE, apiKey: "wrong", maxRetries: 0 });
  try { await bad.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 4 }); }
  catch (e) { check(e instanceof OpenAI.AuthenticationError, "401 class " + e.constructor.name); return asErr(e); }
  check(false, "no 401");
});
await step("err.param", async () => {
  try { await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], temperature: 5 }); }
  catch (e) {
    check(e instanceof OpenAI.BadRequestError, "400 class");
    check(e.param === "temperature" && e.type === "invalid_request_error" && typeof e.code === "string", "400 fields");
    check(e.message.startsWith("400 "), "message: " + e.message);
    check(!!e.requestID, "requestID");
    return asErr(e);
  }
  check(false, "no 400");
});
await step("err.model", async () => {
  try { await client.chat.completions.create({ model: "nope", messages: [{ role: "user", content: "hi" }], max_tokens: 4 }); }
  catch (e) { check(e instanceof OpenAI.NotFoundError, "404 class " + e.constructor.name); return asErr(e); }
  check(false, "no 404");
});
await step("err.models.retrieve", async () => {
  try { await client.models.retrieve("nope"); }
  catch (e) { check(e instanceof OpenAI.NotFoundError, "404 class " + e.constructor.name); return asErr(e); }
  check(false, "no 404");
});
await step("err.responses.param", async () => {
  try { await client.responses.create({ model: MODEL, input: "hi", temperature: 5 }); }
  catch (e) { check(e instanceof OpenAI.BadRequestError && e.param === "temperature", "responses 400"); return asErr(e); }
  check(false, "no 400");
});
await step("err.stream.param", async () => {
  try { const s = await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], stream: true, top_p: 0 }); for await (const c of s) {} }
  catch (e) { check(e instanceof OpenAI.BadRequestError && e.param === "top_p", "stream 400"); return asErr(e); }
  check(false, "no 400");
});
// a long stream holds the only sequence id; a second request meets 429 + Retry-After and the
// SDK retries it; the abort mid-stream must free the sequence.
await step("err.429.retry_and_abort", async () => {
  const ac = new AbortController();
  const s = await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }],
    max_tokens: 4000, stream: true, ignore_eos: true }, { signal: ac.signal });
  const it = s[Symbol.asyncIterator]();
  await it.next(); await it.next();
  const noRetry = new OpenAI({ baseURL: BASE, apiKey: "sekrit", maxRetries: 0 });
  let e429;
  try { await noRetry.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "x" }], max_tokens: 2 }); }
  catch (e) { e429 = asErr(e); check(e instanceof OpenAI.RateLimitError, "429 class " + e.constructor.name); }
  // the retrying client: abort the holder after 300 ms, so its first retry (after Retry-After) is served
  const t0 = Date.now();
  const later = client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "x" }], max_tokens: 2 })
    .withResponse();
  setTimeout(() => ac.abort(), 300);
  let aborted = null;
  try { while (!(await it.next()).done) {} } catch (e) { aborted = e.constructor.name; }
  const { data, response } = await later;
  // the SDK's Stream ends its iteration quietly on an abort (no APIUserAbortError): a loop
  // reading it just stops
  check(aborted === null || aborted === "APIUserAbortError", "abort class " + aborted);
  const idle = await waitIdle();
  check(idle, "server idle after abort");
  return { e429, aborted, retried_ms: Date.now() - t0, finish: data.choices[0].finish_reason, idle };
});
await step("err.abort.responses", async () => {
  const ac = new AbortController();
  const s = await client.responses.create({ model: MODEL, input: "hi", max_output_tokens: 4000, stream: true },
    { signal: ac.signal });
  let n = 0, aborted = null;
  try { for await (const e of s) { if (++n === 5) ac.abort(); } } catch (e) { aborted = e.constructor.name; }
  const idle = await waitIdle();
  check(idle, "idle after responses abort");
  return { n, aborted, idle };
});
await step("err.abort.before_headers", async () => {
  const ac = new AbortController();
  const p = client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 3000,
    ignore_eos: true }, { signal: ac.signal });
  setTimeout(() => ac.abort(), 100);
  let aborted = null;
  try { await p; } catch (e) { aborted = e.constructor.name; }
  const idle = await waitIdle();
  check(idle, "idle after non-stream abort");
  return { aborted, idle };
});
await step("err.timeout", async () => {
  const c = new OpenAI({ baseURL: BASE, apiKey: "sekrit", maxRetries: 0, timeout: 200 });
  let cls = null;
  try { await c.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 3000, ignore_eos: true }); }
  catch (e) { cls = e.constructor.name; }
  const idle = await waitIdle();
  check(idle, "idle after client timeout");
  return { cls, idle };
});
done();
