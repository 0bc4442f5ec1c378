"""Read a pytest junit report; print the node ids of the skipped tests (one a line) to the
file given, a summary to stdout; exit 1 when the report holds no test that ran."""

import sys
import xml.etree.ElementTree as ET


def node_id(classname: str, name: str) -> str:
    if not classname:  # a whole module skipped at collection: name is its dotted path
        return name.replace(".", "/") + ".py"
    parts = classname.split(".")
    module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1:], name])


def main(report: str, out: str) -> int:
    ran, skipped = 0, []
    for case in ET.parse(report).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            ran += 1
        else:
            skipped.append((node_id(case.get("classname", ""), case.get("name", "")),
                            skip.get("message", "")))
    with open(out, "w", encoding="utf-8") as f:
        f.writelines(f"{nid}\n" for nid, _ in skipped)
    print(f"ci: {ran} tests ran, {len(skipped)} skipped")
    for nid, message in skipped:
        print(f"  {nid}: {message[:160]}")
    if ran == 0:
        print("ci: the report holds no test that ran", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
