// Shared by the probe scripts: the server's URL from $CALEXEC_URL, a tag per step (POST
// /__mark, which the recording server keeps and the plain server answers 404), and a check.
export const URL_ = process.env.CALEXEC_URL ?? "http://127.0.0.1:8000";
export const BASE = `${URL_}/v1`;
export const MODEL = process.env.CALEXEC_MODEL ?? "calexec-qwen3-synthetic";
export let failures = 0;
export async function mark(tag) {
  try { await fetch(`${URL_}/__mark`, { method: "POST", body: JSON.stringify({ tag }) }); } catch {}
}
export function check(cond, what) {
  if (!cond) { failures++; console.log("  FAIL", what); }
}
export async function step(tag, fn) {
  await mark(tag);
  try {
    const r = await fn();
    console.log("OK", tag, JSON.stringify(r)?.slice(0, 300));
    return r;
  } catch (e) {
    failures++;
    console.log("EXC", tag, e?.constructor?.name, String(e?.message ?? e).slice(0, 600));
  }
}
export function done() {
  console.log(failures ? `FAILURES ${failures}` : "ALL OK");
  process.exitCode = failures ? 1 : 0;
}
