// zod 4 schemas, as the JS libraries turn them into JSON Schema, through the grammar: each
// answer must parse with the same zod schema on the client.
import OpenAI from "openai";
import { zodResponseFormat } from "openai/helpers/zod";
import { generateObject } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { ChatOpenAI } from "@langchain/openai";
import { z } from "zod";
import { BASE, MODEL, step, check, done } from "./common.mjs";

const S = {
  int: z.object({ n: z.int() }),
  int_bounded: z.object({ n: z.number().int().min(-5).max(5) }),
  positive: z.object({ x: z.number().positive().max(10) }),
  enum: z.object({ c: z.enum(["red", "green"]) }),
  literal: z.object({ k: z.literal("fixed") }),
  nullable: z.object({ s: z.string().max(4).nullable() }),
  optional: z.object({ s: z.string().max(4).optional() }),
  union: z.object({ u: z.union([z.number().int().min(0).max(9), z.boolean()]) }),
  discriminated: z.object({ d: z.discriminatedUnion("kind", [z.object({ kind: z.literal("a"), a: z.boolean() }),
    z.object({ kind: z.literal("b"), b: z.boolean() })]) }),
  array: z.object({ xs: z.array(z.boolean()).min(1).max(3) }),
  tuple: z.object({ t: z.tuple([z.boolean(), z.number().int().min(0).max(3)]) }),
  record: z.object({ r: z.record(z.string().max(3), z.boolean()) }),
  email: z.object({ e: z.email().max(20) }),
  uuid: z.object({ id: z.uuid() }),
  datetime: z.object({ t: z.iso.datetime() }),
  date: z.object({ t: z.iso.date() }),
  regex: z.object({ p: z.string().regex(/^[a-c]{2}$/) }),
  nested: z.object({ o: z.object({ inner: z.object({ b: z.boolean() }) }) }),
  default: z.object({ b: z.boolean().default(true) }),
  describe: z.object({ b: z.boolean().describe("a flag") }),
  recursive: (() => { const Node = z.object({ v: z.boolean(), get kids() { return z.array(Node).max(1); } }); return z.object({ root: Node }); })(),
  intersection: z.object({ i: z.intersection(z.object({ a: z.boolean() }), z.object({ b: z.boolean() })) }),
};
const only = process.argv[2];
const sdk = new OpenAI({ baseURL: BASE, apiKey: "none", maxRetries: 0 });
const openai = createOpenAI({ baseURL: BASE, apiKey: "none" });
for (const [name, schema] of Object.entries(S)) {
  if (only && !name.startsWith(only)) continue;
  await step(`zod.sdk.${name}`, async () => {
    let rf;
    try { rf = zodResponseFormat(schema, "out"); } catch (e) { return { clientRefused: e.message.slice(0, 150) }; }
    try {
      const r = await sdk.chat.completions.parse({ model: MODEL, messages: [{ role: "user", content: "x" }], response_format: rf, max_tokens: 200 });
      const c = r.choices[0];
      check(c.finish_reason === "stop", `${name} finish ${c.finish_reason}`);
      const ok = schema.safeParse(c.message.parsed);
      check(ok.success, `${name} zod parse ${JSON.stringify(ok.error?.issues)?.slice(0, 200)} of ${c.message.content}`);
      return c.message.parsed;
    } catch (e) { check(false, `${name} ${e.constructor.name}`); return { err: e.message.slice(0, 300) }; }
  });
  for (const [k, model] of [["resp", openai(MODEL)], ["chat", openai.chat(MODEL)]]) {
    await step(`zod.ai.${k}.${name}`, async () => {
      try {
        const r = await generateObject({ model, schema, prompt: "x", maxOutputTokens: 200, maxRetries: 0 });
        return r.object;
      } catch (e) { check(false, `${k} ${name} ${e.constructor.name}`); return { err: e.message.slice(0, 300), text: e.text?.slice(0, 200) }; }
    });
  }
  await step(`zod.lc.${name}`, async () => {
    try {
      const m = new ChatOpenAI({ model: MODEL, apiKey: "none", maxTokens: 200, maxRetries: 0, configuration: { baseURL: BASE } });
      return await m.withStructuredOutput(schema, { method: "jsonSchema" }).invoke("x");
    } catch (e) { check(false, `lc ${name} ${e.constructor.name}`); return { err: e.message.slice(0, 300) }; }
  });
}
done();
