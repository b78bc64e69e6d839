//! Tool-call parsing against mlx-lm 0.32.2 itself (tests/oracle/tool_calls.py): the same
//! texts fed to mlx-lm's parsers and server formatting and to mlxb's give the same calls (name,
//! `arguments` text byte for byte, the model's own ids) or both fail; and the same parser is
//! inferred from the same chat template and vocabulary.

mod common;

use mlxb::engine::tool_calls::{infer_parser_name, openai_tool_call, ToolParser, PARSERS};
use serde_json::{json, Value};

/// A tool schema with every kind of parameter type Qwen3-Coder's parser distinguishes.
fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "scale": {"type": "number"}, "metric": {"type": "boolean"},
                "options": {"type": "object"}, "hours": {"type": "array"},
                "free": {}, "untyped": {"description": "no type"},
                "either": {"type": ["string", "null"]}, "count": {"type": " Int32 "},
                "ratio": {"type": "float"}, "mapping": {"type": "dict"},
                "mode": {"enum": ["a", 1, 2.5, true, null]},
                "choice": {"anyOf": [{"type": "integer"}, {"type": "string"}]}
            }, "required": ["city"]}}},
        {"type": "function", "function": {"name": "no_params"}}
    ])
}

fn corpus() -> Vec<(&'static str, String)> {
    let mut c: Vec<(&str, String)> = Vec::new();
    let mut add =
        |p: &'static str, texts: &[&str]| c.extend(texts.iter().map(|t| (p, t.to_string())));
    add(
        "json_tools",
        &[
            "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n",
            "{\"name\":\"f\",\"arguments\":{\"z\":1,\"a\":[1.5,2e20,-0.0001,1e-7,3.0],\"u\":\"h\u{e9}llo \u{1f600}\",\"n\":null,\"t\":true}}",
            "{\"name\": \"f\", \"arguments\": {}, \"id\": \"call_7\"}",
            "[{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {\"y\": \"2\"}}]",
            "{\"name\": \"f\", \"arguments\": \"{\\\"already\\\": \\\"a string\\\"}\"}",
            "{\"name\": \"f\", \"arguments\": {\"q\": \"line\\nbreak \\\"quoted\\\" \\\\ tab\\t\"}, \"extra\": 5}",
            "{\"name\": \"f\", \"arguments\": {\"dup\": 1, \"dup\": 2}}",
            "{\"name\": \"f\"}",
            "{\"name\": \"f\", \"arguments\": {\"city\": \"Par",
            "not json at all",
            "",
            "  \t\n",
            "\"just a string\"",
        ],
    );
    add(
        "qwen3_coder",
        &[
            "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n",
            "<function=get_weather><parameter=city>New\nYork</parameter><parameter=scale>2.50</parameter><parameter=metric>True</parameter></function>",
            "<function=get_weather>\n<parameter=days>\n4.0\n</parameter>\n<parameter=scale>\n7.0\n</parameter>\n<parameter=ratio>\n1e3\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=days>\n4.5\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=days>\nmany\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=count>\n 1_000 \n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=options>\n{\"a\": [1, 2], \"b\": \"x\ty\"}\n</parameter>\n<parameter=hours>\n[1, 2, 3]\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=options>\n{'a': (1, 2), 'b': None, 'c': True}\n</parameter>\n<parameter=mapping>\n{'k': -3.5}\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=hours>\nnot a list\n</parameter>\n<parameter=either>\n['x']\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=free>\n{\"k\": 1}\n</parameter>\n<parameter=untyped>\n{\"k\": 2}\n</parameter>\n<parameter=untyped2>\n[1]\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=untyped>\n42\n</parameter>\n<parameter=city>\nNULL\n</parameter>\n</function>",
            "<function=unknown_fn>\n<parameter=days>\n3\n</parameter>\n</function>",
            "<function=no_params>\n</function>",
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>",
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
            "no function here",
            "<function=>\n</function>",
            "<function=get_weather>\n<parameter=metric>\nFALSE\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>",
        ],
    );
    add(
        "mistral",
        &[
            "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
            "[{\"name\": \"a\", \"arguments\": \"{\\\"x\\\": 1}\", \"id\": \"abc123def\"}, {\"name\": \"b\"}]",
            "[{\"name\": \"a\", \"arguments\": [1]}]",
            "get_weather[ARGS]{\"city\": \"Paris\"}",
            "get_weather [ARGS] {\"city\": \"Paris\"}add-one[ARGS]{\"n\": 1.5}",
            "get_weather[ARGS]{\"city\": \"Par",
            "{\"name\": \"f\", \"arguments\": {}}",
            "plain text",
        ],
    );
    add(
        "gemma4",
        &[
            "call:get_weather{city:<|\"|>Paris<|\"|>,days:3}",
            "call:get_weather{city:<|\"|>a {brace} , x:y<|\"|>,opts:{deep:{n:1.5},list:[1,2]},ok:true}",
            "call:a{x:1}call:b-c{y:<|\"|>two<|\"|>}",
            "call:f{}",
            "call:f{city:<|\"|>unterminated}",
            "call:f{city:Paris}",
            "nothing here",
            "call:f{k:<|\"|>multi\nline<|\"|>,n:null}",
        ],
    );
    add(
        "minicpm5",
        &[
            "\"get_weather\"><param name=\"city\">Paris</param><param name=\"days\">3</param>",
            "<function name=\"get_weather\"><param name=\"city\"><![CDATA[a < b & c\nd]]></param></function>",
            "'get_weather'>\n<param name='days'> 4.0 </param>\n<param name=scale>2.5</param>\n<param name=\"metric\">Yes</param>\n",
            "\"get_weather\"><param name=\"options\">{'a': (1, 2)}</param><param name=\"hours\">[1, 2]</param><param name=\"either\">None</param>",
            "\"get_weather\"><param name=\"mode\">2.5</param><param name=\"choice\">7</param><param name=\"days\">seven</param><param name=\"metric\">maybe</param>",
            "\"get_weather\"><param name=\"untyped\">{\"k\": 1}</param><param name=\"unknown\">5</param><param name=\"city\">null</param>",
            "\"a\"><param name=\"x\">1</param></function><function name=\"b\"><param name=\"y\">2</param>",
            "\"no_params\">",
            "no function here",
            "\"get_weather\"><param name=\"days\">1_000</param><param name=\"scale\">1e400</param>",
        ],
    );
    add(
        "function_gemma",
        &[
            "call:get_weather{city:<escape>Paris<escape>,days:3}",
            "call:get_weather{days:3,metric:true,scale:1.5}",
            "call:f{city:<escape>Pa,ris<escape>}",
            "call:f{name:value with spaces}",
            "call:f{}",
            "call:f{novalue}",
            "call:f{k:<escape>open}",
            "no call",
            "call:f{a:<escape>x<escape>\u{e9}b:2}",
        ],
    );
    c
}

fn oracle(args: &[&str]) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("q.json");
    let out = dir.path().join("out.json");
    std::fs::write(&q, args[args.len() - 1]).unwrap();
    let mut argv: Vec<&str> = args[..args.len() - 1].to_vec();
    argv.extend([q.to_str().unwrap(), out.to_str().unwrap()]);
    common::run_python(&common::root().join("tests/oracle/tool_calls.py"), &argv);
    serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
}

#[test]
fn every_parser_reads_texts_as_mlx_lm_does() {
    let tools = tools();
    let corpus = corpus();
    let queries: Vec<Value> = corpus
        .iter()
        .map(|(p, t)| json!({"parser": p, "text": t, "tools": tools}))
        .collect();
    let answers = oracle(&[&serde_json::to_string(&queries).unwrap()]);
    let tools = tools.as_array().unwrap().clone();
    let (mut parsed, mut failed) = (0, 0);
    for ((name, text), want) in corpus.iter().zip(&answers) {
        let parser = ToolParser::from_name(name).unwrap();
        let got: Result<Vec<Value>, String> = parser
            .parse(text, Some(&tools))
            .map_err(|e| e.to_string())
            .and_then(|calls| {
                calls
                    .into_iter()
                    .map(|c| {
                        let model_id = c.get("id").cloned();
                        let mut v = openai_tool_call(c, None).map_err(|e| e.to_string())?;
                        let o = v.as_object_mut().unwrap();
                        match model_id {
                            Some(id @ Value::String(_)) if id != "" => {
                                o.insert("id".into(), id);
                            }
                            _ => {
                                o.shift_remove("id");
                            }
                        }
                        Ok(v)
                    })
                    .collect()
            });
        match (want.get("calls"), got) {
            (Some(calls), Ok(got)) => {
                // Byte-for-byte on the arguments text: compare serialized forms.
                assert_eq!(
                    serde_json::to_string(&got).unwrap(),
                    serde_json::to_string(calls).unwrap(),
                    "{name} on {text:?}"
                );
                parsed += 1;
            }
            (None, Err(_)) => failed += 1,
            (Some(calls), Err(e)) => {
                panic!("{name} on {text:?}: mlx-lm parses {calls}, mlxb fails: {e}")
            }
            (None, Ok(got)) => panic!(
                "{name} on {text:?}: mlx-lm fails ({}), mlxb parses {got:?}",
                want["error"]
            ),
        }
    }
    assert!(
        parsed >= 30 && failed >= 15,
        "{parsed} parsed, {failed} failed"
    );
}

#[test]
fn the_parser_is_inferred_from_the_template_as_mlx_lm_infers_it() {
    let mut cases: Vec<(Option<String>, Vec<&str>)> = Vec::new();
    let templates = [
        "{% for tool in tools %}<tool_call>{{ tool_call.name }}</tool_call>{% endfor %}",
        "<tool_call>\\n<function={{ name }}> <tool_call> tool_call.name",
        "<tool_call>\n<function=",
        "[TOOL_CALLS] {{ x }}",
        "<|tool_call>call:{{ n }}<tool_call|>",
        "<start_function_call>",
        "<minimax:tool_call>",
        "<|tool_call_start|>",
        "<function name=\"x\"><param name=\"y\">",
        "plain {{ messages }}",
        "<tool_call> without the name",
    ];
    for t in templates {
        cases.push((Some(t.to_owned()), vec![]));
    }
    cases.push((None, vec!["<|tool_call_start|>", "<|tool_call_end|>"]));
    cases.push((
        Some("plain".into()),
        vec!["<|tool_call_start|>", "<|tool_call_end|>"],
    ));
    cases.push((None, vec!["<|tool_call_start|>"]));
    let queries: Vec<Value> = cases
        .iter()
        .map(|(t, v)| json!({"template": t, "vocab": v}))
        .collect();
    let answers = oracle(&["infer", &serde_json::to_string(&queries).unwrap()]);
    for ((template, vocab), want) in cases.iter().zip(&answers) {
        let got = infer_parser_name(template.as_deref(), |t| vocab.contains(&t));
        assert_eq!(
            got,
            want.as_str(),
            "template {template:?}, vocabulary {vocab:?}"
        );
    }
    // Every parser mlxb has is one mlx-lm infers or names.
    assert_eq!(PARSERS.len(), 6);
}
