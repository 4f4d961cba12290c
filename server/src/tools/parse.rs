//! The model's output split, as it streams, into the text the user sees and
//! the calls it makes. Text that might be the start of a call opener, and
//! whitespace that might only separate calls, is held back until the next
//! text decides it; a call is returned whole when its closing tag arrives.
//! A block that is not a call (not JSON, no such tool) stays text, so
//! nothing the model wrote is lost.
//!
//! Small models often leave the tags out and answer with the call's JSON
//! alone (Qwen2.5-Coder-0.5B does, greedy): an answer that begins with
//! `{"name"` is held to its end, and is calls if it is nothing but call
//! objects (llama.cpp's Hermes parser accepts the same).
use serde_json::Value;

use super::{CALL_CLOSE, CALL_OPEN};

/// A call as parsed: the tool's name and its arguments as compact JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// What a piece of output became.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub text: String,
    pub calls: Vec<ParsedCall>,
}

pub struct CallSplitter {
    /// The tools a call may name.
    names: Vec<String>,
    /// Undecided output: in text, a possible opener's start and the
    /// whitespace before it; in a call, the call so far.
    held: String,
    in_call: bool,
    /// Nothing but whitespace so far: an untagged call may still begin.
    at_start: bool,
    /// The answer began as an untagged call: held whole until the end.
    bare: bool,
    calls: usize,
}

/// How an untagged call begins (after `{` and any whitespace).
const BARE_KEY: &str = "\"name\"";

/// Whether `text` (the answer so far, whitespace trimmed) begins an untagged
/// call: `Some(true)` it does, `Some(false)` it cannot, `None` not yet known.
fn begins_bare_call(text: &str) -> Option<bool> {
    let Some(rest) = text.strip_prefix('{') else { return Some(false) };
    let rest = rest.trim_start();
    if rest.starts_with(BARE_KEY) {
        Some(true)
    } else if BARE_KEY.starts_with(rest) {
        None
    } else {
        Some(false)
    }
}

impl CallSplitter {
    pub fn new(names: Vec<String>) -> CallSplitter {
        CallSplitter { names, held: String::new(), in_call: false, at_start: true, bare: false, calls: 0 }
    }

    /// Whether a call has been returned.
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    /// Takes the next decoded text.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        if self.at_start {
            let begun = self.held.trim_start();
            if begun.is_empty() {
                return out;
            }
            match begins_bare_call(begun) {
                None => return out,
                Some(bare) => {
                    self.at_start = false;
                    self.bare = bare;
                }
            }
        }
        if self.bare {
            return out;
        }
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CALL_CLOSE) else { break };
                let body: String = self.held.drain(..end + CALL_CLOSE.len()).collect();
                self.in_call = false;
                self.close(&body[..end], true, &mut out);
            } else if let Some(start) = self.held.find(CALL_OPEN) {
                let before: String = self.held.drain(..start + CALL_OPEN.len()).collect();
                // Whitespace between calls, or before the first, is not text.
                out.text.push_str(before[..start].trim_end());
                self.in_call = true;
            } else {
                // Keep a tail that may grow into the opener, and the
                // whitespace before it.
                let partial = (1..CALL_OPEN.len()).rev().find(|&n| self.held.ends_with(&CALL_OPEN[..n])).unwrap_or(0);
                let decided = self.held.len() - partial;
                let keep_from = self.held[..decided].trim_end().len();
                out.text.extend(self.held.drain(..keep_from));
                break;
            }
        }
        out
    }

    /// The output ended: an unclosed call is parsed as it stands; held text
    /// is released (trailing whitespace after calls is dropped).
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let held = std::mem::take(&mut self.held);
        if self.bare {
            match self.parse_all(&held) {
                Some(calls) => {
                    self.calls += calls.len();
                    out.calls = calls;
                }
                None => out.text = held,
            }
        } else if self.in_call {
            self.in_call = false;
            self.close(&held, false, &mut out);
        } else if !(self.made_calls() && held.trim().is_empty()) {
            out.text = held;
        }
        out
    }

    /// A call's body, after the opener (and before the closing tag when
    /// `closed`): a call, or back to the text the model wrote.
    fn close(&mut self, body: &str, closed: bool, out: &mut Split) {
        match self.parse(body) {
            Some(call) => {
                self.calls += 1;
                out.calls.push(call);
            }
            None => {
                out.text.push_str(CALL_OPEN);
                out.text.push_str(body);
                if closed {
                    out.text.push_str(CALL_CLOSE);
                }
            }
        }
    }

    /// An untagged answer: one or more call objects and nothing else.
    fn parse_all(&self, text: &str) -> Option<Vec<ParsedCall>> {
        let values: Vec<Value> = serde_json::Deserializer::from_str(text).into_iter().collect::<Result<_, _>>().ok()?;
        values.into_iter().map(|v| self.call(v)).collect()
    }

    /// `{"name": <a tool>, "arguments": {...}}` (or `"parameters"`, or the
    /// arguments as a JSON string of an object).
    fn parse(&self, body: &str) -> Option<ParsedCall> {
        self.call(serde_json::from_str(body.trim()).ok()?)
    }

    fn call(&self, value: Value) -> Option<ParsedCall> {
        let Value::Object(mut call) = value else { return None };
        let name = call.get("name")?.as_str()?.to_string();
        if !self.names.contains(&name) {
            return None;
        }
        let arguments = match call.remove("arguments").or_else(|| call.remove("parameters")) {
            None => Value::Object(Default::default()),
            Some(Value::String(s)) => serde_json::from_str(&s).ok().filter(Value::is_object)?,
            Some(v @ Value::Object(_)) => v,
            Some(_) => return None,
        };
        Some(ParsedCall { name, arguments: arguments.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn splitter() -> CallSplitter {
        CallSplitter::new(vec!["weather".into(), "time".into()])
    }

    /// Feeds `pieces` and returns the text and calls, with finish.
    fn run(s: &mut CallSplitter, pieces: &[&str]) -> (String, Vec<ParsedCall>) {
        let (mut text, mut calls) = (String::new(), Vec::new());
        let mut splits: Vec<Split> = pieces.iter().map(|p| s.push(p)).collect();
        splits.push(s.finish());
        for p in splits {
            text.push_str(&p.text);
            calls.extend(p.calls);
        }
        (text, calls)
    }

    fn call(name: &str, args: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: args.into() }
    }

    #[test]
    fn calls_split_from_text_across_any_piece_boundaries() {
        let out = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let want = (String::from("Let me check."), vec![call("weather", "{\"city\":\"Paris\",\"days\":2}"), call("time", "{}")]);
        // Whole, then in every two-piece cut, then character by character.
        assert_eq!(run(&mut splitter(), &[out]), want);
        for cut in (1..out.len()).filter(|&i| out.is_char_boundary(i)) {
            assert_eq!(run(&mut splitter(), &[&out[..cut], &out[cut..]]), want, "cut at {cut}");
        }
        let chars: Vec<String> = out.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&mut splitter(), &pieces), want);
    }

    #[test]
    fn text_without_calls_passes_whole_and_held_text_comes_back() {
        let mut s = splitter();
        assert_eq!(s.push("a < b\n").text, "a < b");
        assert_eq!(s.push("<tool").text, "");
        assert_eq!(s.push("s are fun").text, "\n<tools are fun");
        assert_eq!(s.push("\n\n").text, "");
        assert_eq!(s.finish().text, "\n\n");
        assert!(!s.made_calls());
    }

    #[test]
    fn blocks_that_are_not_calls_stay_text() {
        for body in ["not json", "{\"name\": \"nope\", \"arguments\": {}}", "{\"arguments\": {}}", "{\"name\": \"time\", \"arguments\": 3}"] {
            let out = format!("<tool_call>\n{body}\n</tool_call>");
            let (text, calls) = run(&mut splitter(), &[&out]);
            assert!(calls.is_empty(), "{body}");
            assert_eq!(text, out);
        }
        // Arguments given as a JSON string, or under `parameters`.
        let (_, calls) = run(&mut splitter(), &["<tool_call>{\"name\": \"time\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}</tool_call>"]);
        assert_eq!(calls, [call("time", "{\"tz\":\"UTC\"}")]);
        let (_, calls) = run(&mut splitter(), &["<tool_call>{\"name\": \"time\", \"parameters\": {\"tz\": 1}}</tool_call>"]);
        assert_eq!(calls, [call("time", "{\"tz\":1}")]);
    }

    #[test]
    fn an_untagged_answer_of_calls_is_calls() {
        let out = " {\"name\": \"time\", \"arguments\": {}}\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n";
        let chars: Vec<String> = out.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&mut splitter(), &pieces), (String::new(), vec![call("time", "{}"), call("weather", "{\"city\":\"Oslo\"}")]));
        // Anything else in it: all text, as written.
        for out in ["{\"name\": \"time\", \"arguments\": {}} and more", "{\"name\": \"Ann\"}", "{\"x\": 1}", "{ \"na"] {
            assert_eq!(run(&mut splitter(), &[out]), (out.to_string(), vec![]), "{out}");
        }
        // JSON that is not a call streams as it comes.
        let mut s = splitter();
        assert_eq!(s.push("{\"na").text, "");
        assert_eq!(s.push("ture\": 1}").text, "{\"nature\": 1}");
    }

    #[test]
    fn an_unclosed_call_is_parsed_at_the_end() {
        let (text, calls) = run(&mut splitter(), &["<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n"]);
        assert_eq!((text.as_str(), calls), ("", vec![call("time", "{}")]));
        let (text, calls) = run(&mut splitter(), &["<tool_call>\n{\"name\": \"time\", \"argu"]);
        assert_eq!((text.as_str(), calls.len()), ("<tool_call>\n{\"name\": \"time\", \"argu", 0));
    }
}
