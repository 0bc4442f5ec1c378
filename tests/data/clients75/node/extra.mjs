// More of the AI SDK and LangChain JS: logprobs streamed, Output with tools, enum/array/
// no-schema objects, toolChoice none, LangChain streamEvents and batch, the SDK's runTools streamed.
import { generateText, streamText, generateObject, streamObject, tool, stepCountIs, Output } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { ChatOpenAI } from "@langchain/openai";
import OpenAI from "openai";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const openai = createOpenAI({ baseURL: BASE, apiKey: "none" });
const compat = createOpenAICompatible({ name: "calexec", baseURL: BASE, includeUsage: true, supportsStructuredOutputs: true });
const M = { resp: openai(MODEL), chat: openai.chat(MODEL), compat: compat.chatModel(MODEL) };
const weather = tool({ description: "weather", inputSchema: z.object({ city: z.string().max(8) }), execute: async () => "sunny" });
for (const [k, model] of Object.entries(M)) {
  await step(`x.${k}.stream.logprobs`, async () => {
    const r = streamText({ model, prompt: "hi", maxOutputTokens: 4, maxRetries: 0, providerOptions: { openai: { logprobs: 2 } },
      onError: ({ error }) => check(false, "onError " + String(error?.message ?? JSON.stringify(error)).slice(0, 200)) });
    for await (const _ of r.textStream);
    const meta = await r.providerMetadata;
    return { finish: await r.finishReason, lp: JSON.stringify(meta?.openai?.logprobs)?.slice(0, 120) };
  });
  await step(`x.${k}.enum`, async () => {
    const r = await generateObject({ model, output: "enum", enum: ["red", "green"], prompt: "a colour", maxOutputTokens: 32, maxRetries: 0 });
    check(["red", "green"].includes(r.object), "enum");
    return r.object;
  });
  await step(`x.${k}.array`, async () => {
    const r = streamObject({ model, output: "array", schema: z.object({ n: z.number().int().min(0).max(9) }), prompt: "numbers",
      maxOutputTokens: 64, maxRetries: 0, onError: ({ error }) => console.log("  onError", String(error?.message).slice(0, 200)) });
    const els = [];
    for await (const e of r.elementStream) els.push(e);
    return { els: els.length, finish: await r.finishReason };
  });
  await step(`x.${k}.noschema`, async () => {
    try {
      const r = await generateObject({ model, output: "no-schema", prompt: "json", maxOutputTokens: 32, maxRetries: 0 });
      return r.object;
    } catch (e) { return { cls: e.constructor.name, message: e.message.slice(0, 200) }; }
  });
  await step(`x.${k}.output_with_tools`, async () => {
    const r = await generateText({ model, prompt: "weather?", tools: { weather }, maxOutputTokens: 128, maxRetries: 0,
      stopWhen: stepCountIs(3), output: Output.object({ schema: z.object({ ok: z.boolean() }) }) });
    let out; try { out = r.output; } catch (e) { out = e.constructor.name; }
    return { steps: r.steps.map((s) => s.finishReason), out };
  });
  await step(`x.${k}.toolChoice.none`, async () => {
    const r = await generateText({ model, prompt: "weather?", tools: { weather }, toolChoice: "none", maxOutputTokens: 8, maxRetries: 0 });
    check(r.toolCalls.length === 0, "no calls");
    return r.finishReason;
  });
}
await step("x.lc.streamEvents", async () => {
  const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 8, maxRetries: 0, configuration: { baseURL: BASE } });
  const kinds = {};
  for await (const e of m.streamEvents("hi", { version: "v2" })) kinds[e.event] = (kinds[e.event] ?? 0) + 1;
  const b = await m.batch(["a", "b", "c"]);
  return { kinds, batch: b.map((x) => x.response_metadata.finish_reason) };
});
await step("x.lc.strict_tools", async () => {
  const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 256, maxRetries: 0, configuration: { baseURL: BASE } })
    .bindTools([{ type: "function", function: { name: "f", description: "d", parameters: { type: "object",
      properties: { a: { type: "integer", minimum: 0, maximum: 9 } }, required: ["a"], additionalProperties: false } } }],
    { strict: true, tool_choice: "f", parallel_tool_calls: false });
  const r = await m.invoke("go");
  check(r.tool_calls.length === 1, "one call");
  return r.tool_calls;
});
await step("x.sdk.runTools.stream", async () => {
  const c = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 0 });
  const runner = c.chat.completions.runTools({ model: MODEL, stream: true, max_tokens: 128, tool_choice: "auto",
    stream_options: { include_usage: true }, messages: [{ role: "user", content: "weather?" }],
    tools: [{ type: "function", function: { name: "get_weather", function: (a) => "sunny", parse: JSON.parse,
      parameters: { type: "object", properties: { city: { type: "string", maxLength: 8 } }, required: ["city"] } } }] });
  const final = await runner.finalChatCompletion();
  const usage = await runner.totalUsage();
  return { finish: final.choices[0].finish_reason, usage };
});
done();
