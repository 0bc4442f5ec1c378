// The AI SDK's call settings and provider options, each as its provider sends them; a 400 must
// name what the server does not take.
import { generateText, streamText, generateObject, embed, tool, stepCountIs } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import OpenAI from "openai";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const openai = createOpenAI({ baseURL: BASE, apiKey: "none" });
const compat = createOpenAICompatible({ name: "calexec", baseURL: BASE, includeUsage: true });
const M = { resp: openai(MODEL), chat: openai.chat(MODEL), compat: compat.chatModel(MODEL) };
const info = (r) => ({ text: r.text?.slice(0, 40), finish: r.finishReason, warnings: r.warnings?.map((w) => w.type + ":" + (w.feature ?? w.setting ?? w.message)) });
const err = (e) => ({ cls: e.constructor.name, status: e.statusCode, message: String(e.message).slice(0, 300) });
const settings = { seed: 3, topP: 0.9, temperature: 0.7, topK: 5, presencePenalty: 0.1, frequencyPenalty: 0.1,
  stopSequences: ["zz"] };
const popts = {
  resp: [{ parallelToolCalls: false }, { user: "u1" }, { metadata: { a: "b" } }, { textVerbosity: "low" },
    { logprobs: 2 }, { serviceTier: "auto" }, { reasoningEffort: "low" }, { promptCacheKey: "k" },
    { safetyIdentifier: "s" }, { maxToolCalls: 2 }, { truncation: "auto" }, { instructions: "brief" },
    { include: ["message.output_text.logprobs"] }, { strictJsonSchema: false }, { store: false }],
  chat: [{ logprobs: 2 }, { user: "u1" }, { parallelToolCalls: false }, { logitBias: { 300: -5 } },
    { maxCompletionTokens: 5 }, { store: false }, { metadata: { a: "b" } }, { serviceTier: "auto" },
    { textVerbosity: "low" }, { reasoningEffort: "low" }, { promptCacheKey: "k" }, { safetyIdentifier: "s" },
    { prediction: { type: "content", content: "x" } }, { strictJsonSchema: false }],
};
for (const [k, model] of Object.entries(M)) {
  await step(`opt.${k}.settings`, async () => {
    try { return info(await generateText({ model, prompt: "hi", maxOutputTokens: 8, maxRetries: 0, ...settings })); }
    catch (e) { return err(e); }
  });
  for (const o of popts[k] ?? []) {
    await step(`opt.${k}.${Object.keys(o)[0]}`, async () => {
      try {
        const r = await generateText({ model, prompt: "hi", maxOutputTokens: 8, maxRetries: 0,
          providerOptions: { openai: o } });
        return { ...info(r), lp: r.providerMetadata?.openai?.logprobs ? "logprobs" : undefined };
      } catch (e) { return err(e); }
    });
  }
  await step(`opt.${k}.image`, async () => {
    try {
      await generateText({ model, maxOutputTokens: 8, maxRetries: 0, messages: [{ role: "user", content: [
        { type: "text", text: "what is it" }, { type: "image", image: new URL("https://example.com/a.png") }] }] });
    } catch (e) { return err(e); }
    check(false, "image taken");
  });
  await step(`opt.${k}.toolChoice.named`, async () => {
    const weather = tool({ inputSchema: z.object({ city: z.string().max(8) }), execute: async () => "sunny" });
    const r = await generateText({ model, prompt: "weather?", tools: { weather }, toolChoice: { type: "tool", toolName: "weather" },
      maxOutputTokens: 256, maxRetries: 0 });
    check(r.toolCalls.length >= 1, "named call");
    return { finish: r.finishReason, calls: r.toolCalls.length };
  });
  await step(`opt.${k}.tools.auto.multistep`, async () => {
    const weather = tool({ description: "weather", inputSchema: z.object({ city: z.string().max(8) }), execute: async () => "sunny" });
    const r = await generateText({ model, prompt: "weather?", tools: { weather }, stopWhen: stepCountIs(3),
      maxOutputTokens: 32, maxRetries: 0 });
    return r.steps.map((s) => s.finishReason);
  });
}
await step("opt.compat.generateObject.default", async () => {
  const c = createOpenAICompatible({ name: "calexec", baseURL: BASE });
  try {
    const r = await generateObject({ model: c.chatModel(MODEL), schema: z.object({ ok: z.boolean() }), prompt: "x",
      maxOutputTokens: 32, maxRetries: 0 });
    return r.object;
  } catch (e) { return err(e); }
});
await step("opt.embed", async () => {
  try { await embed({ model: openai.embedding("x"), value: "hi", maxRetries: 0 }); } catch (e) { return err(e); }
});
await step("opt.sdk.embed", async () => {
  const c = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 0 });
  try { await c.embeddings.create({ model: MODEL, input: "hi" }); } catch (e) { return { cls: e.constructor.name, status: e.status, message: e.message }; }
});
await step("opt.sdk.n2.stream", async () => {
  const c = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 0 });
  const s = c.chat.completions.stream({ model: MODEL, messages: [{ role: "user", content: "hi" }], n: 2, max_tokens: 4,
    stream_options: { include_usage: true }, logprobs: true, top_logprobs: 2 });
  const f = await s.finalChatCompletion();
  check(f.choices.length === 2 && f.usage?.total_tokens > 0, "n=2 choices+usage");
  return f.choices.map((c) => [c.finish_reason, c.logprobs?.content?.length]);
});
done();
