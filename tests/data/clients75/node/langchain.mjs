// @langchain/openai's ChatOpenAI against calexec serve.
import { ChatOpenAI, OpenAI as LCOpenAI } from "@langchain/openai";
import { HumanMessage, ToolMessage } from "@langchain/core/messages";
import { tool } from "@langchain/core/tools";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const mk = (extra = {}) => new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 8, maxRetries: 0,
  configuration: { baseURL: BASE }, ...extra });
const Person = z.object({ name: z.string().max(8), age: z.number().int().min(0).max(120) });
const weather = tool(async ({ city }) => `sunny in ${city}`, { name: "get_weather", description: "weather",
  schema: z.object({ city: z.string().max(8) }) });

for (const [k, extra] of [["chat", {}], ["resp", { useResponsesApi: true }]]) {
  await step(`lc.${k}.invoke`, async () => {
    const m = await mk(extra).invoke("say hi");
    check(m.usage_metadata && m.usage_metadata.input_tokens + m.usage_metadata.output_tokens === m.usage_metadata.total_tokens, "usage");
    return { content: m.content, usage: m.usage_metadata, meta: m.response_metadata };
  });
  await step(`lc.${k}.stream`, async () => {
    let acc;
    for await (const c of await mk({ ...extra, streamUsage: true }).stream("say hi")) acc = acc ? acc.concat(c) : c;
    check(acc.usage_metadata?.total_tokens > 0, "stream usage " + JSON.stringify(acc.usage_metadata));
    return { content: acc.content, usage: acc.usage_metadata, meta: acc.response_metadata };
  });
  await step(`lc.${k}.bindTools`, async () => {
    const llm = mk({ ...extra, maxTokens: 256 }).bindTools([weather], { tool_choice: k === "resp" ? "get_weather" : "any" });
    const m = await llm.invoke("weather in Paris?");
    check(m.tool_calls?.[0]?.name === "get_weather" && typeof m.tool_calls[0].args.city === "string", "tool call");
    const res = await weather.invoke(m.tool_calls[0]);
    const m2 = await mk({ ...extra }).bindTools([weather]).invoke([new HumanMessage("weather in Paris?"), m, res]);
    return { calls: m.tool_calls, invalid: m.invalid_tool_calls, next: m2.content };
  });
  await step(`lc.${k}.bindTools.stream`, async () => {
    const llm = mk({ ...extra, maxTokens: 256 }).bindTools([weather], { tool_choice: k === "resp" ? "get_weather" : "any" });
    let acc;
    for await (const c of await llm.stream("weather in Paris?")) acc = acc ? acc.concat(c) : c;
    check(acc.tool_calls?.[0]?.name === "get_weather" && typeof acc.tool_calls[0].args.city === "string", "streamed tool call");
    return { calls: acc.tool_calls, invalid: acc.invalid_tool_calls };
  });
  for (const method of ["jsonSchema", "functionCalling", "jsonMode"]) {
    await step(`lc.${k}.structured.${method}`, async () => {
      const s = mk({ ...extra, maxTokens: 256 }).withStructuredOutput(Person, { method, includeRaw: true });
      const r = await s.invoke("a person");
      if (method !== "jsonMode") check(typeof r.parsed?.name === "string", "parsed");
      return { parsed: r.parsed, raw: r.raw.content };
    });
  }
}
// @langchain/openai 1.5.8's Responses path drops a string tool_choice ("any", "required",
// "auto", "none"): the request goes without one (the model may answer text). Recorded as sent.
await step("lc.resp.bindTools.any_dropped", async () => {
  const m = await mk({ useResponsesApi: true, maxTokens: 16 }).bindTools([weather], { tool_choice: "any" })
    .invoke("weather in Paris?");
  return { calls: m.tool_calls.length, text: typeof m.content };
});
await step("lc.llm.invoke", async () => {
  const llm = new LCOpenAI({ model: MODEL, apiKey: "none", maxTokens: 8, maxRetries: 0, configuration: { baseURL: BASE } });
  const t = await llm.invoke("Hello");
  let s = "";
  for await (const c of await llm.stream("Hello")) s += c;
  check(s === t, "stream text = invoke text");
  return [t, s];
});
done();
