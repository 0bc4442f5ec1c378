// The openai SDK as a browser page runs it (dangerouslyAllowBrowser) against a server started
// with cors_origins ["http://app.example"]: a fetch that sends the page's Origin and, as a
// browser does, lets the script read only the CORS-safelisted response headers and those the
// server's access-control-expose-headers names. A 504 of the request's own deadline carries
// x-should-retry: false; the SDK must see it and not retry.
import OpenAI from "openai";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const SAFE = new Set(["cache-control", "content-language", "content-length", "content-type", "expires",
  "last-modified", "pragma"]);
let sent = 0;
const browserFetch = async (url, init) => {
  const headers = new Headers(init?.headers);
  headers.set("origin", "http://app.example");
  sent++;
  const r = await fetch(url, { ...init, headers });
  check(r.headers.get("access-control-allow-origin") === "http://app.example", "allowed origin");
  const exposed = new Set((r.headers.get("access-control-expose-headers") ?? "").split(",").map((h) => h.trim().toLowerCase()));
  const visible = new Headers();
  for (const [k, v] of r.headers) if (SAFE.has(k) || exposed.has(k)) visible.set(k, v);
  return new Response(r.body, { status: r.status, statusText: r.statusText, headers: visible });
};
const client = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 2, dangerouslyAllowBrowser: true, fetch: browserFetch });
await step("cors.own_deadline_not_retried", async () => {
  sent = 0;
  try {
    await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "hi" }], max_tokens: 3000,
      ignore_eos: true, timeout: 0.2 });
  } catch (e) {
    check(e.status === 504, "504");
    check(sent === 1, `sent ${sent} times (x-should-retry: false not visible to the page)`);
    return { status: e.status, sent, requestID: e.requestID, shouldRetry: e.headers?.get("x-should-retry") };
  }
  check(false, "no 504");
});
await step("cors.request_id_visible", async () => {
  const { data, response, request_id } = await client.chat.completions.create({ model: MODEL,
    messages: [{ role: "user", content: "hi" }], max_tokens: 2 }).withResponse();
  check(request_id === data.id, "request id visible");
  return { request_id };
});
done();
