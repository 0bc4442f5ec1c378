// The Vercel AI SDK (`ai`, `@ai-sdk/openai`, `@ai-sdk/openai-compatible`) against calexec serve.
import { generateText, streamText, generateObject, streamObject, tool, stepCountIs, jsonSchema } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const openai = createOpenAI({ baseURL: BASE, apiKey: "none" });
const compat = createOpenAICompatible({ name: "calexec", baseURL: BASE, apiKey: "none",
  includeUsage: true, supportsStructuredOutputs: true });
const models = { resp: openai(MODEL), chat: openai.chat(MODEL), compat: compat.chatModel(MODEL),
  cmpl: openai.completion(MODEL) };
const Person = z.object({ name: z.string().max(8), age: z.number().int().min(0).max(120) });
const weather = tool({ description: "weather of a city", inputSchema: z.object({ city: z.string().max(8) }),
  execute: async ({ city }) => `sunny in ${city}` });
const usageOk = (u) => u && u.inputTokens > 0 && u.inputTokens + u.outputTokens === u.totalTokens;

for (const [k, model] of Object.entries(models)) {
  await step(`ai.${k}.generateText`, async () => {
    const r = await generateText({ model, prompt: "say hi", maxOutputTokens: 8, maxRetries: 0 });
    check(usageOk(r.usage), `${k} usage ${JSON.stringify(r.usage)}`);
    check(["stop", "length"].includes(r.finishReason), `${k} finish ${r.finishReason}`);
    return { text: r.text, finish: r.finishReason, usage: r.usage, warnings: r.warnings };
  });
  await step(`ai.${k}.streamText`, async () => {
    const r = streamText({ model, prompt: "say hi", maxOutputTokens: 8, maxRetries: 0,
      onError: ({ error }) => console.log("  onError", String(error).slice(0, 300)) });
    let text = "";
    for await (const t of r.textStream) text += t;
    const usage = await r.usage, finish = await r.finishReason;
    check(usageOk(usage), `${k} stream usage ${JSON.stringify(usage)}`);
    check(["stop", "length"].includes(finish), `${k} stream finish ${finish}`);
    check(text === (await r.text), "text");
    return { text, finish, usage };
  });
  if (k === "cmpl") continue;
  await step(`ai.${k}.generateObject`, async () => {
    const r = await generateObject({ model, schema: Person, prompt: "a person", maxOutputTokens: 256, maxRetries: 0 });
    check(typeof r.object.name === "string", "object");
    return { object: r.object, finish: r.finishReason, usage: r.usage };
  });
  await step(`ai.${k}.streamObject`, async () => {
    const r = streamObject({ model, schema: Person, prompt: "a person", maxOutputTokens: 256, maxRetries: 0,
      onError: ({ error }) => console.log("  onError", String(error).slice(0, 300)) });
    let parts = 0;
    for await (const p of r.partialObjectStream) parts++;
    const o = await r.object;
    return { parts, o, usage: await r.usage };
  });
  await step(`ai.${k}.tools`, async () => {
    const r = await generateText({ model, prompt: "weather in Paris?", tools: { weather }, toolChoice: "required",
      stopWhen: stepCountIs(2), maxOutputTokens: 256, maxRetries: 0 });
    check(r.steps.length === 2, "two steps " + r.steps.length);
    check(r.steps[0].finishReason === "tool-calls", "step0 finish " + r.steps[0].finishReason);
    check(r.steps[0].toolResults?.[0]?.output?.startsWith("sunny"), "tool result");
    return r.steps.map((s) => ({ finish: s.finishReason, calls: s.toolCalls.map((c) => c.input), text: s.text }));
  });
  await step(`ai.${k}.tools.stream`, async () => {
    const r = streamText({ model, prompt: "weather in Paris?", tools: { weather }, toolChoice: "required",
      stopWhen: stepCountIs(2), maxOutputTokens: 256, maxRetries: 0,
      onError: ({ error }) => console.log("  onError", String(error).slice(0, 300)) });
    const kinds = new Set();
    for await (const p of r.fullStream) { kinds.add(p.type); if (p.type === "error") check(false, "error part " + String(p.error).slice(0, 200)); }
    const steps = await r.steps;
    check(steps[0].finishReason === "tool-calls", "stream step0 " + steps[0].finishReason);
    return { kinds: [...kinds], steps: steps.map((s) => s.finishReason), usage: await r.totalUsage };
  });
}
done();
