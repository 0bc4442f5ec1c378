// The openai SDK's Responses stream helper and parse with function tools (zodResponsesFunction).
import OpenAI from "openai";
import { zodResponsesFunction, zodTextFormat } from "openai/helpers/zod";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const c = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 0 });
const Weather = z.object({ city: z.string().max(8) });
await step("rs.stream.tools", async () => {
  const s = c.responses.stream({ model: MODEL, input: "weather?", max_output_tokens: 256, tool_choice: "required",
    tools: [{ type: "function", name: "get_weather", strict: true, parameters: z.toJSONSchema(Weather) }] });
  const seen = {};
  s.on("response.function_call_arguments.delta", () => { seen.delta = (seen.delta ?? 0) + 1; });
  s.on("response.function_call_arguments.done", (e) => { seen.done = e.arguments; });
  const f = await s.finalResponse();
  const calls = f.output.filter((o) => o.type === "function_call");
  check(calls.length >= 1 && typeof JSON.parse(calls[0].arguments).city === "string", "calls");
  check(seen.done === calls.at(-1).arguments, "done arguments");
  return { status: f.status, calls: calls.length, seen };
});
await step("rs.parse.tools", async () => {
  const r = await c.responses.parse({ model: MODEL, input: "weather?", max_output_tokens: 256, tool_choice: "required",
    tools: [zodResponsesFunction({ name: "get_weather", parameters: Weather })] });
  const call = r.output.find((o) => o.type === "function_call");
  check(typeof call?.parsed_arguments?.city === "string", "parsed_arguments");
  return call;
});
await step("rs.stream.parse", async () => {
  const s = c.responses.stream({ model: MODEL, input: "a person", max_output_tokens: 256,
    text: { format: zodTextFormat(z.object({ ok: z.boolean() }), "o") } });
  const f = await s.finalResponse();
  check(typeof f.output_parsed?.ok === "boolean", "output_parsed");
  return f.output_parsed;
});
await step("rs.stream.logprobs", async () => {
  const s = c.responses.stream({ model: MODEL, input: "hi", max_output_tokens: 4, top_logprobs: 2,
    include: ["message.output_text.logprobs"] });
  const f = await s.finalResponse();
  const lp = f.output[0].content[0].logprobs;
  check(lp?.length === 4, "4 logprobs " + lp?.length);
  return lp?.[0];
});
done();
