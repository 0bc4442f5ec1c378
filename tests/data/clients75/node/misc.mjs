import { generateText, streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { ChatOpenAI } from "@langchain/openai";
import { BASE, MODEL, step, check, done } from "./common.mjs";
const openai = createOpenAI({ baseURL: BASE, apiKey: "none" });
for (const o of [{ echo: true }, { logprobs: 2 }, { suffix: "x" }, { user: "u" }, { logitBias: { 300: -5 } }]) {
  await step(`misc.cmpl.${Object.keys(o)[0]}`, async () => {
    try { const r = await generateText({ model: openai.completion(MODEL), prompt: "Hello", maxOutputTokens: 4, maxRetries: 0, providerOptions: { openai: o } });
      return { text: r.text, finish: r.finishReason, lp: !!r.providerMetadata?.openai?.logprobs }; }
    catch (e) { return { status: e.statusCode, message: e.message.slice(0, 200) }; }
  });
}
await step("misc.lc.logprobs", async () => {
  const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 4, maxRetries: 0, logprobs: true, topLogprobs: 2, configuration: { baseURL: BASE } });
  const r = await m.invoke("hi");
  check(r.response_metadata.logprobs?.content?.length === 4, "lc logprobs");
  let acc; for await (const c of await m.stream("hi")) acc = acc ? acc.concat(c) : c;
  return { n: r.response_metadata.logprobs?.content?.length, streamed: acc.response_metadata.logprobs?.content?.length };
});
await step("misc.lc.n2", async () => {
  const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 4, maxRetries: 0, n: 2, configuration: { baseURL: BASE } });
  const r = await m.generate([["hi"]]);
  return r.generations[0].map((g) => g.text);
});
done();
