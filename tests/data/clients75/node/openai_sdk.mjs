// The `openai` npm package against calexec serve.
import OpenAI from "openai";
import { zodResponseFormat, zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const client = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 0 });
const msgs = [{ role: "user", content: "say hi" }];
const usageOk = (u) => u && u.prompt_tokens > 0 && u.prompt_tokens + u.completion_tokens === u.total_tokens;

await step("sdk.chat", async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages: msgs, max_tokens: 8 });
  check(r.object === "chat.completion" && r.id.startsWith("chatcmpl-"), "chat id/object");
  check(usageOk(r.usage), "chat usage");
  check(["stop", "length"].includes(r.choices[0].finish_reason), "chat finish");
  return r.choices[0];
});
await step("sdk.chat.stream", async () => {
  const s = await client.chat.completions.create({ model: MODEL, messages: msgs, max_tokens: 8, stream: true,
    stream_options: { include_usage: true } });
  let text = "", usage = null, finish = null, n = 0;
  for await (const c of s) {
    n++;
    if (c.usage) usage = c.usage;
    for (const ch of c.choices) { text += ch.delta?.content ?? ""; if (ch.finish_reason) finish = ch.finish_reason; }
  }
  check(usageOk(usage), "stream usage"); check(finish === "length", "stream finish " + finish);
  return { n, text, usage, finish };
});
await step("sdk.chat.stream.helper", async () => {
  const s = client.chat.completions.stream({ model: MODEL, messages: msgs, max_tokens: 8,
    stream_options: { include_usage: true } });
  const final = await s.finalChatCompletion();
  check(usageOk(final.usage), "stream helper usage");
  return final;
});
const tools = [{ type: "function", function: { name: "get_weather", description: "weather",
  parameters: { type: "object", properties: { city: { type: "string", maxLength: 8 } }, required: ["city"],
    additionalProperties: false } } }];
await step("sdk.chat.tools.required", async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages: [{ role: "user", content: "weather in Paris?" }],
    tools, tool_choice: "required", max_tokens: 256 });
  const tc = r.choices[0].message.tool_calls;
  check(r.choices[0].finish_reason === "tool_calls" && tc?.length >= 1, "tool_calls finish");
  check(tc && typeof JSON.parse(tc[0].function.arguments).city === "string", "tool args");
  // the round trip
  const r2 = await client.chat.completions.create({ model: MODEL, max_tokens: 8, tools,
    messages: [{ role: "user", content: "weather in Paris?" }, r.choices[0].message,
      { role: "tool", tool_call_id: tc[0].id, content: "sunny" }] });
  return [r.choices[0], r2.choices[0]];
});
await step("sdk.chat.tools.stream", async () => {
  const s = client.chat.completions.stream({ model: MODEL, messages: [{ role: "user", content: "weather?" }],
    tools, tool_choice: { type: "function", function: { name: "get_weather" } }, max_tokens: 256 });
  const final = await s.finalChatCompletion();
  const tc = final.choices[0].message.tool_calls;
  check(tc?.[0]?.function?.name === "get_weather", "stream tool name");
  check(tc && typeof JSON.parse(tc[0].function.arguments).city === "string", "stream tool args");
  return final.choices[0];
});
await step("sdk.chat.tools.runTools", async () => {
  const runner = client.chat.completions.runTools({ model: MODEL, max_tokens: 32,
    messages: [{ role: "user", content: "weather?" }], tool_choice: "auto",
    tools: [{ type: "function", function: { name: "get_weather", function: (a) => "sunny in " + a.city,
      parse: JSON.parse, parameters: tools[0].function.parameters } }] });
  const content = await runner.finalContent();
  return content;
});
const Person = z.object({ name: z.string().max(8), age: z.number().int().min(0).max(120) });
await step("sdk.chat.parse", async () => {
  const r = await client.chat.completions.parse({ model: MODEL, messages: [{ role: "user", content: "a person" }],
    response_format: zodResponseFormat(Person, "person"), max_tokens: 256 });
  const p = r.choices[0].message.parsed;
  check(r.choices[0].finish_reason !== "stop" || (p && typeof p.name === "string"), "parsed");
  return r.choices[0];
});
await step("sdk.chat.parse.tool", async () => {
  const { zodFunction } = await import("openai/helpers/zod");
  const r = await client.chat.completions.parse({ model: MODEL, messages: [{ role: "user", content: "a person" }],
    tools: [zodFunction({ name: "save", parameters: Person })], tool_choice: "required", max_tokens: 256 });
  const tc = r.choices[0].message.tool_calls;
  check(tc?.[0]?.function?.parsed_arguments?.name !== undefined, "parsed tool args");
  return r.choices[0];
});
await step("sdk.chat.stream.parse", async () => {
  const s = client.chat.completions.stream({ model: MODEL, messages: [{ role: "user", content: "a person" }],
    response_format: zodResponseFormat(Person, "person"), max_tokens: 256 });
  const final = await s.finalChatCompletion();
  return final.choices[0];
});
await step("sdk.completions", async () => {
  const r = await client.completions.create({ model: MODEL, prompt: "Hello", max_tokens: 8, logprobs: 2 });
  check(usageOk(r.usage), "completions usage");
  return r.choices[0];
});
await step("sdk.completions.stream", async () => {
  const s = await client.completions.create({ model: MODEL, prompt: ["Hello", "World"], max_tokens: 4, stream: true,
    stream_options: { include_usage: true } });
  const seen = {}; let usage = null;
  for await (const c of s) { if (c.usage) usage = c.usage; for (const ch of c.choices) if (ch.finish_reason) seen[ch.index] = ch.finish_reason; }
  check(usageOk(usage), "completions stream usage");
  return { seen, usage };
});
await step("sdk.models", async () => {
  const out = [];
  for await (const m of client.models.list()) out.push(m);
  check(out.some((m) => m.id === MODEL), "model listed");
  const one = await client.models.retrieve(MODEL);
  check(one.id === MODEL, "model retrieve");
  return out;
});
await step("sdk.responses", async () => {
  const r = await client.responses.create({ model: MODEL, input: "say hi", max_output_tokens: 8 });
  check(typeof r.output_text === "string", "output_text");
  check(r.usage && r.usage.input_tokens + r.usage.output_tokens === r.usage.total_tokens, "responses usage");
  return { status: r.status, text: r.output_text, inc: r.incomplete_details };
});
await step("sdk.responses.instructions", async () => {
  const r = await client.responses.create({ model: MODEL, instructions: "be brief",
    input: [{ role: "user", content: [{ type: "input_text", text: "hi" }] }], max_output_tokens: 8 });
  return r.output_text;
});
await step("sdk.responses.stream", async () => {
  const s = await client.responses.create({ model: MODEL, input: "say hi", max_output_tokens: 8, stream: true });
  const types = []; let text = "";
  for await (const e of s) { types.push(e.type); if (e.type === "response.output_text.delta") text += e.delta; }
  return { types: [...new Set(types)], text };
});
await step("sdk.responses.stream.helper", async () => {
  const s = client.responses.stream({ model: MODEL, input: "say hi", max_output_tokens: 8 });
  const final = await s.finalResponse();
  return final.status;
});
await step("sdk.responses.parse", async () => {
  const r = await client.responses.parse({ model: MODEL, input: "a person", max_output_tokens: 256,
    text: { format: zodTextFormat(Person, "person") } });
  check(r.status !== "completed" || typeof r.output_parsed?.name === "string", "output_parsed");
  return { status: r.status, parsed: r.output_parsed };
});
await step("sdk.responses.tools", async () => {
  const rtools = [{ type: "function", name: "get_weather", parameters: tools[0].function.parameters, strict: true }];
  const r = await client.responses.create({ model: MODEL, input: "weather?", tools: rtools, tool_choice: "required",
    max_output_tokens: 256 });
  const call = r.output.find((o) => o.type === "function_call");
  check(call && typeof JSON.parse(call.arguments).city === "string", "responses call");
  const r2 = await client.responses.create({ model: MODEL, tools: rtools, max_output_tokens: 8,
    input: [{ role: "user", content: "weather?" }, call, { type: "function_call_output", call_id: call.call_id, output: "sunny" }] });
  return [call, r2.status];
});
done();
